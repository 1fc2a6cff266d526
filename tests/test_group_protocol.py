"""Every call the trainer makes on an actor group is one every group serves: the methods it calls on a group
(`actor_group.<method>(...)`, `self.actor_group.<method>(...)`) are on the `ActorGroup` protocol
(workers/actor_group.py), and the RPC names it gives them (`.call("<rpc>", ...)`, `.wait("<rpc>", ...)`,
`forward_logprobs(actor_group, "<rpc>", ...)`) are declared by a part (workers/parts/) or are the rank base's own.
A method reached only through a wrapper's `__getattr__` (the ledger's re-score was, on one group) fails here, not
mid-run.

Runs where: in the pytest process; reads mindspeed_rl/trainer/ with `ast`, imports the worker modules.
"""
import ast
import inspect
from pathlib import Path

TRAINER = Path(__file__).resolve().parents[1] / "mindspeed_rl" / "trainer"
RPC_NAMING_METHODS = ("call", "wait")  # their first argument names the RPC
RPC_NAMING_FUNCTIONS = {"forward_logprobs": 1}  # function -> the position of the RPC name


def _is_group(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id == "actor_group") or \
        (isinstance(node, ast.Attribute) and node.attr == "actor_group")


def _literal(node: ast.Call, position: int) -> str | None:
    if len(node.args) > position and isinstance(node.args[position], ast.Constant):
        return node.args[position].value if isinstance(node.args[position].value, str) else None
    return None


def trainer_calls(source: str, where: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """([(where:line, method called on a group)], [(where:line, RPC name given to a group)]) of one module."""
    methods, rpcs = [], []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func, at = node.func, f"{where}:{node.lineno}"
        if isinstance(func, ast.Attribute) and _is_group(func.value):
            methods.append((at, func.attr))
            if func.attr in RPC_NAMING_METHODS and (name := _literal(node, 0)) is not None:
                rpcs.append((at, name))
        elif isinstance(func, ast.Name) and func.id in RPC_NAMING_FUNCTIONS and node.args and _is_group(node.args[0]):
            if (name := _literal(node, RPC_NAMING_FUNCTIONS[func.id])) is not None:
                rpcs.append((at, name))
    return methods, rpcs


def _all_trainer_calls() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    methods, rpcs = [], []
    for path in sorted(TRAINER.rglob("*.py")):
        found = trainer_calls(path.read_text(), path.relative_to(TRAINER.parent).as_posix())
        methods += found[0]
        rpcs += found[1]
    return methods, rpcs


def _protocol_methods() -> set[str]:
    from mindspeed_rl.workers.actor_group import ActorGroup

    return {name for name, member in vars(ActorGroup).items() if callable(member) and not name.startswith("_")}


def _served_rpcs() -> set[str]:
    """Every part's declared RPCs, and the rank base's own public methods (offload_states, resident_bytes, ...)."""
    from mindspeed_rl.workers.parts import declared_rpcs
    from mindspeed_rl.workers.rank_worker import RankWorker
    from mindspeed_rl.workers.roles import ALL_PARTS

    declared = {name for part in ALL_PARTS for name in declared_rpcs(part)}
    base = {name for name, member in inspect.getmembers(RankWorker) if callable(member) and not name.startswith("_")}
    return declared | base


def test_every_method_the_trainer_calls_on_a_group_is_on_the_protocol():
    methods, _ = _all_trainer_calls()
    called = {name for _, name in methods}
    assert {"call", "start_generate", "finish_generate", "start_score", "finish_score"} <= called, "the walk sees them"
    protocol = _protocol_methods()
    missing = [f"{at} .{name}()" for at, name in methods if name not in protocol]
    assert not missing, f"called on a group, not on the ActorGroup protocol: {missing}"


def test_every_rpc_the_trainer_names_is_declared_by_a_part_or_the_rank_base():
    _, rpcs = _all_trainer_calls()
    named = {name for _, name in rpcs}
    assert {"update", "compute_log_prob", "compute_ref_log_prob", "compute_replayed_log_prob"} <= named, \
        "the walk sees them"
    served = _served_rpcs()
    missing = [f"{at} {name!r}" for at, name in rpcs if name not in served]
    assert not missing, f"no part declares these RPCs: {missing}"


def test_the_walk_finds_a_call_off_the_protocol_and_an_undeclared_rpc():
    source = ("def f(actor_group, batch):\n"
              "    actor_group.start_rescoring(batch)\n"
              "    self.actor_group.call('compute_nothing', batch)\n"
              "    forward_logprobs(actor_group, 'compute_log_prob', batch)\n"
              "    other.call('not_a_group_call')\n")
    methods, rpcs = trainer_calls(source, "m.py")
    assert methods == [("m.py:2", "start_rescoring"), ("m.py:3", "call")]
    assert rpcs == [("m.py:3", "compute_nothing"), ("m.py:4", "compute_log_prob")]
    assert "start_rescoring" not in _protocol_methods() and "compute_nothing" not in _served_rpcs()
