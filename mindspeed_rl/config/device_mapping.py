"""`device_mapping` values, read as ROLL writes them (``list(range(0,16))``, ``[0,1,2,3]``, ``range(4,8)``, lists joined
with ``+``), without ever evaluating them: ``ast.parse`` and a whitelist walk; and device lists written back as spans."""

from __future__ import annotations

import ast
from typing import Any

from mindspeed_rl.errors import ConfigError

ACCEPTED_FORMS = (
    "a list of device indices such as [0,1,2,3], range(4,8), range(0,16,2), range(8), list(range(0,16)), "
    "or lists joined with + such as list(range(0,4)) + [6,7]"
)
# Longer strings and larger mappings are not device lists; refusing them keeps the parser's work bounded.
MAX_MAPPING_TEXT = 4096
MAX_DEVICES = 1 << 16


class _Refused(Exception):
    """A part of the mapping outside the accepted forms; the message says which part."""


def parse_device_mapping(value: Any, key: str) -> tuple[int, ...]:
    """The device indices of a ``device_mapping`` value: a string in one of :data:`ACCEPTED_FORMS`, or a
    YAML list of indices. Raises ConfigError naming ``key``. The string is parsed into a syntax tree and
    only list literals, ``range``, ``list`` and ``+`` are interpreted; nothing is evaluated or imported."""
    if isinstance(value, bool) or not isinstance(value, (str, list, tuple)):
        hint = f" (did you mean [{value}] or range({value})?)" if isinstance(value, int) and value >= 0 else ""
        raise ConfigError(key, f"expected {ACCEPTED_FORMS}; got {value!r}{hint}")
    if isinstance(value, str):
        devices = _parse_text(value, key)
    else:
        try:
            devices = [_as_index(item) for item in value]
        except _Refused as refused:
            raise ConfigError(key, f"{refused} in {list(value)!r}; expected {ACCEPTED_FORMS}") from None
    if not devices:
        raise ConfigError(key, f"lists no device: {value!r}")
    seen: set[int] = set()
    for device in devices:
        if device < 0:
            raise ConfigError(key, f"device indices must be >= 0, got {device} in {value!r}")
        if device in seen:
            raise ConfigError(key, f"lists device {device} twice in {value!r}: a worker owns its devices")
        seen.add(device)
    return tuple(devices)


def _parse_text(text: str, key: str) -> list[int]:
    shown = text if len(text) <= 120 else text[:117] + "..."
    if len(text) > MAX_MAPPING_TEXT:
        raise ConfigError(key, f"is {len(text)} characters long, more than {MAX_MAPPING_TEXT}; expected {ACCEPTED_FORMS}")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ConfigError(key, f"cannot read {shown!r}: expected {ACCEPTED_FORMS}") from None
    try:
        # A bare range() is a mapping (ROLL's eval gives a range, which it lists); inside + only lists join.
        return _range_value(tree.body) if _is_call(tree.body, "range") else _list_value(tree.body)
    except (_Refused, RecursionError) as refused:
        why = str(refused) if isinstance(refused, _Refused) else "nested too deeply"
        raise ConfigError(key, f"cannot read {shown!r}: {why}; expected {ACCEPTED_FORMS} (the string is parsed, "
                               "never run)") from None


def _list_value(node: ast.AST) -> list[int]:
    """A term that Python would evaluate to a list: a list literal, list(...), or list + list."""
    if isinstance(node, ast.List):
        return [_as_index(_int_literal(element)) for element in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        # As in Python, + joins lists only: range(0,4) + [4] is a TypeError there, so it is refused here.
        return _list_value(node.left) + _list_value(node.right)
    if _is_call(node, "list"):
        if len(node.args) != 1:
            raise _Refused(f"list() takes one range or list, got {len(node.args)} arguments")
        inner = node.args[0]
        return _range_value(inner) if _is_call(inner, "range") else _list_value(inner)
    if _is_call(node, "range"):
        raise _Refused("range() joined with + is a TypeError in Python: write list(range(...))")
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        raise _Refused(f"{node.func.id}() is not accepted (only range and list)")
    if isinstance(node, ast.Call):
        raise _Refused("only range() and list() may be called")
    if isinstance(node, ast.BinOp):
        raise _Refused(f"operator {type(node.op).__name__} is not accepted (only + between lists)")
    raise _Refused(f"{_describe(node)} is not accepted")


def _range_value(node: ast.AST) -> list[int]:
    assert isinstance(node, ast.Call)
    if not 1 <= len(node.args) <= 3:
        raise _Refused(f"range() takes 1 to 3 integers, got {len(node.args)}")
    bounds = [_int_literal(argument) for argument in node.args]
    try:
        steps = range(*bounds)
    except ValueError as error:  # a step of 0
        raise _Refused(f"range{tuple(bounds)}: {error}") from None
    if len(steps) > MAX_DEVICES:
        raise _Refused(f"range{tuple(bounds)} has {len(steps)} devices, more than {MAX_DEVICES}")
    return list(steps)


def _is_call(node: ast.AST, name: str) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name
            and not node.keywords and not any(isinstance(a, ast.Starred) for a in node.args))


def _int_literal(node: ast.AST) -> int:
    """An integer written as a literal, optionally negative (a range's step)."""
    negative = isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub)
    operand = node.operand if negative else node
    if isinstance(operand, ast.Constant) and type(operand.value) is int:
        return -operand.value if negative else operand.value
    raise _Refused(f"{_describe(node)} is not an integer")


def _as_index(item: Any) -> int:
    if type(item) is not int:
        raise _Refused(f"{item!r} is not a device index")
    return item


def _describe(node: ast.AST) -> str:
    try:
        text = ast.unparse(node)
    except Exception:  # pragma: no cover - unparse handles every node ast.parse makes
        text = type(node).__name__
    return repr(text if len(text) <= 60 else text[:57] + "...")


def format_devices(devices: tuple[int, ...] | list[int]) -> str:
    """Indices as spans, e.g. ``0-3,6,7``; ``cpu`` for none."""
    if not devices:
        return "cpu"
    ordered = sorted(devices)
    spans, start, previous = [], ordered[0], ordered[0]
    for device in ordered[1:] + [None]:
        if device is not None and device == previous + 1:
            previous = device
            continue
        spans.append(str(start) if start == previous else f"{start}-{previous}" if previous > start + 1
                     else f"{start},{previous}")
        if device is not None:
            start = previous = device
    return ",".join(spans)


def own_devices_follow(plan, key: str, *, later: tuple[str, ...] = ()) -> bool:
    """Whether role `key` of `plan` (config/resources.ResourcePlan) has devices apart from actor_train's, a group of
    its own (the critic's, the teacher's); those must be the devices right after every other role's but the `later`
    roles' (ranks start in that order), else ConfigError naming the role's key."""
    role, train = plan.role(key), plan.role("actor_train")
    if set(role.devices) & set(train.devices):
        return False
    taken = max(d for other in plan.roles if other.key not in (key, *later) for d in other.devices) + 1
    following = tuple(range(taken, taken + len(role.devices)))
    if role.devices != following:
        raise ConfigError(role.source, f"a {key} on devices of its own takes those after the other roles', "
                                       f"list(range({following[0]},{following[-1] + 1})), got "
                                       f"{format_devices(role.devices)}: its ranks start after the others, on the "
                                       "devices Ray gives them")
    return True
