"""The docs a newcomer reads: README.md and docs/*.md.

- README.md stays short (at most 200 lines) and links every page of docs/, so every page is reachable from it;
- every relative markdown link and image in README.md and docs/*.md names a file that exists and, for
  `file.md#anchor`, a heading of that file (GitHub's anchor rules);
- every documented command that runs `python cli/train_grpo.py`, `cli/train_dapo.py` or `cli/plan.py` with
  `--config-name NAME` (and no `--config-dir`) names a shipped config, configs/NAME.yaml, and each `key=value`
  override names a key of the config schema (`mindspeed_rl.config.GRPOConfig`; `hydra.*` is Hydra's);
- every `make X` the docs show names a target of the Makefile.

Text only: nothing here runs a command.
"""

import dataclasses
import re
import shlex
import types
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 200

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"`[^`]*`")
ENTRY_POINTS = ("cli/train_grpo.py", "cli/train_dapo.py", "cli/plan.py")
SHELL_OPERATORS = {"&&", "||", "|", ";", ">", ">>", "<", "2>", "2>&1", "&"}


def doc_files():
    return [README] + sorted(DOCS.glob("*.md"))


def doc_ids():
    return [str(p.relative_to(ROOT)) for p in doc_files()]


def split_fenced(text):
    """(lines outside fenced code blocks, lines inside them), each as (line number, line)."""
    outside, inside = [], []
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)
            continue
        if fence is not None and line.strip().startswith(fence):
            fence = None
            continue
        (inside if fence is not None else outside).append((number, line))
    return outside, inside


def github_anchor(heading):
    """GitHub's heading id: markup dropped, lowercase, punctuation but '-' and '_' removed, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path):
    found, seen = set(), {}
    outside, _ = split_fenced(path.read_text(encoding="utf-8"))
    for _, line in outside:
        match = HEADING.match(line)
        if not match:
            continue
        base = github_anchor(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path):
    """(line number, target) of every markdown link and image outside code."""
    outside, _ = split_fenced(path.read_text(encoding="utf-8"))
    result = []
    for number, line in outside:
        for match in LINK.finditer(INLINE_CODE.sub("", line)):
            result.append((number, match.group(1)))
    return result


def is_external(target):
    return re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) is not None


def resolve(path, target):
    """(file the link names, anchor or None) for a relative link written in `path`."""
    file_part, _, anchor = target.partition("#")
    destination = path if not file_part else (path.parent / file_part).resolve()
    return destination, (anchor or None)


# --- README: short, and every page reachable ---------------------------------------------------------


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines (at most {MAX_README_LINES})"


def test_readme_links_every_docs_page():
    linked = {resolve(README, target)[0] for _, target in links(README) if not is_external(target)}
    pages = {p.resolve() for p in DOCS.glob("*.md")}
    missing = sorted(str(p.relative_to(ROOT)) for p in pages - linked)
    assert pages, "docs/ has no pages"
    assert not missing, f"README.md does not link: {missing}"


def test_readme_keeps_the_test_command_ci_runs():
    # .ci/run runs `make test` as "the README's test command".
    _, inside = split_fenced(README.read_text(encoding="utf-8"))
    assert any(re.match(r"^\s*make test\b", line) for _, line in inside), "README.md shows no `make test`"


# --- links and images --------------------------------------------------------------------------------


@pytest.mark.parametrize("path", doc_files(), ids=doc_ids())
def test_relative_links_and_images_resolve(path):
    problems = []
    for number, target in links(path):
        if is_external(target):
            continue
        destination, anchor = resolve(path, target)
        where = f"{path.relative_to(ROOT)}:{number}: {target}"
        if not destination.exists():
            problems.append(f"{where}: no such file")
        elif anchor is not None:
            if destination.suffix != ".md":
                problems.append(f"{where}: an anchor into a file that is not markdown")
            elif anchor not in anchors(destination):
                problems.append(f"{where}: no heading with anchor #{anchor} in {destination.relative_to(ROOT)}")
    assert not problems, "\n".join(problems)


def test_the_anchor_rules():
    assert github_anchor("Resources: device_mapping") == "resources-device_mapping"
    assert github_anchor("DAPO's loss and reward options") == "dapos-loss-and-reward-options"
    assert github_anchor("Results (this 2-core CPU machine)") == "results-this-2-core-cpu-machine"
    assert github_anchor("The real recipe (Qwen2.5-7B, MindSpeed-RL's data flow)") == (
        "the-real-recipe-qwen25-7b-mindspeed-rls-data-flow")
    assert github_anchor("The switch: resharding straight into vLLM") == "the-switch-resharding-straight-into-vllm"


# --- documented commands -----------------------------------------------------------------------------


def logical_lines(numbered):
    """Join backslash-continued lines; drop a leading `$ ` prompt."""
    result, buffer, start = [], "", None
    for number, line in numbered:
        if start is None:
            start = number
        stripped = line.rstrip()
        if stripped.endswith("\\"):
            buffer += stripped[:-1] + " "
            continue
        buffer += stripped
        result.append((start, re.sub(r"^\s*\$\s+", "", buffer).strip()))
        buffer, start = "", None
    if buffer:
        result.append((start, re.sub(r"^\s*\$\s+", "", buffer).strip()))
    return result


def command_lines(path):
    """Commands the page shows: every line of its fenced blocks, and lines elsewhere (indented blocks) that
    start with `python cli/`."""
    outside, inside = split_fenced(path.read_text(encoding="utf-8"))
    commands = logical_lines(inside)
    unfenced = [(n, line) for n, line in logical_lines(outside) if line.startswith("python cli/")]
    return commands + unfenced


def entry_point_args(line):
    """The arguments after `python cli/<entry point>.py`, or None when the line runs none of them."""
    if not any(entry in line for entry in ENTRY_POINTS):
        return None
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError:
        return None
    for i, token in enumerate(tokens):
        if token in ENTRY_POINTS and i > 0 and re.match(r"^(python3?|\S*/python3?)$", tokens[i - 1]):
            args = []
            for arg in tokens[i + 1:]:
                if arg in SHELL_OPERATORS:
                    break
                args.append(arg)
            return tokens[i], args
    return None


def parse_args(args):
    """(--config-name, --config-dir, overrides) of a Hydra command line."""
    config_name = config_dir = None
    overrides = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("-"):
            flag, eq, value = arg.partition("=")
            if not eq and i + 1 < len(args) and "=" not in args[i + 1] and not args[i + 1].startswith("-"):
                value = args[i + 1]
                i += 1
            if flag in ("--config-name", "-cn"):
                config_name = value
            elif flag in ("--config-dir", "-cd"):
                config_dir = value
        elif "=" in arg:
            overrides.append(arg)
        i += 1
    return config_name, config_dir, overrides


def unwrap(hint):
    """Optional[X] / X | None -> X."""
    origin = typing.get_origin(hint)
    if origin is typing.Union or (hasattr(types, "UnionType") and isinstance(hint, types.UnionType)):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return unwrap(args[0])
    return hint


def schema_has_key(key):
    from mindspeed_rl.config import GRPOConfig

    parts = key.split(".")
    if parts[0] == "hydra":
        return True
    current = GRPOConfig
    for part in parts:
        current = unwrap(current)
        if dataclasses.is_dataclass(current):
            fields = {f.name for f in dataclasses.fields(current)}
            if part not in fields:
                return False
            current = typing.get_type_hints(current)[part]
        elif typing.get_origin(current) is dict:
            current = typing.get_args(current)[1]  # dict[str, X]: any name, then X
        else:
            return False  # a key below a leaf
    return True


def test_schema_walk():
    assert schema_has_key("megatron_training.train_iters")
    assert schema_has_key("generate_config.sampling_config.max_tokens")
    assert schema_has_key("runtime.ray_address")
    assert schema_has_key("model.qwen25_7b.num_layers")
    assert schema_has_key("rewards.rule.world_size")
    assert schema_has_key("actor_train.device_mapping")
    assert schema_has_key("hydra.run.dir")
    assert not schema_has_key("megatron_training.no_such_key")
    assert not schema_has_key("megatron_training.train_iters.deeper")
    assert not schema_has_key("model.qwen25_7b.no_such_field")


def documented_commands():
    found = []
    for path in doc_files():
        for number, line in command_lines(path):
            parsed = entry_point_args(line)
            if parsed is not None:
                found.append((f"{path.relative_to(ROOT)}:{number}", parsed[0], parsed[1]))
    return found


def test_documented_commands_exist():
    commands = documented_commands()
    assert len(commands) >= 10, "the docs show fewer entry-point commands than expected: is the parser broken?"


@pytest.mark.parametrize("where,entry,args", documented_commands(),
                         ids=[w for w, _, _ in documented_commands()])
def test_documented_command_names_a_config_and_schema_keys(where, entry, args):
    config_name, config_dir, overrides = parse_args(args)
    if config_dir is not None:
        return  # the user's own folder: nothing of ours to check
    problems = []
    if config_name is not None and not (ROOT / "configs" / f"{config_name}.yaml").is_file():
        problems.append(f"--config-name {config_name}: no configs/{config_name}.yaml")
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if not schema_has_key(key):
            problems.append(f"{override}: `{key}` is not a key of the config schema")
    assert not problems, f"{where}: {entry} " + "; ".join(problems)


def makefile_targets():
    targets = set()
    for line in (ROOT / "Makefile").read_text(encoding="utf-8").splitlines():
        match = re.match(r"^([A-Za-z0-9_.\-/ ]+?)\s*:(?!=)", line)
        if match and not line.startswith("\t"):
            targets.update(match.group(1).split())
    return targets


def make_commands(path):
    """(line number, targets) of every `make ...` in a fenced block or an inline code span."""
    text = path.read_text(encoding="utf-8")
    outside, inside = split_fenced(text)
    found = []
    for number, line in logical_lines(inside):
        match = re.match(r"^make\s+(.*)$", line)
        if match:
            found.append((number, match.group(1)))
    for number, line in outside:
        for span in INLINE_CODE.findall(line):
            match = re.match(r"^`make\s+([^`]*)`$", span)
            if match:
                found.append((number, match.group(1)))
    result = []
    for number, rest in found:
        words = shlex.split(rest, comments=True)
        targets = [w for w in words if "=" not in w and not w.startswith("-")]
        result.append((number, targets))
    return result


@pytest.mark.parametrize("path", doc_files(), ids=doc_ids())
def test_make_commands_name_makefile_targets(path):
    targets = makefile_targets()
    problems = [f"{path.relative_to(ROOT)}:{number}: make {t}: no such target in the Makefile"
                for number, named in make_commands(path) for t in named if t not in targets]
    assert not problems, "\n".join(problems)
