"""The engine's shape, read from its source: no import cycle (lazy imports included), one mover of device
states, one rank-group protocol that every group implements, and every worker RPC in a phase of the one table.

Runs where: in the pytest process; reads mindspeed_rl/ with `ast`, imports the worker and group modules.
"""
import ast
import inspect
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mindspeed_rl"
# The states' own implementations (an offloadable state moves itself when asked); everything else asks the
# sharding manager.
# The states' own implementations; the swap optimizer's bucketed step moves its buckets below the manager, which
# moves the group.
STATE_IMPLEMENTATIONS = {"memory/offload.py", "memory/vllm_states.py", "engines/vllm_engine.py",
                         "memory/swap_optimizer.py"}
MOVES = {"offload", "reload", "offload_all", "reload_all", "release_kv_cache", "rebuild_kv_cache"}


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports, at module level or inside functions."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        deps = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                for alias in node.names:
                    deps.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
            elif isinstance(node, ast.Import):
                deps |= {alias.name for alias in node.names}
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if not state.get(dep):
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if not state.get(node):
            found = visit(node)
            if found:
                return found
    return []


def test_the_package_has_no_import_cycle_lazy_imports_included():
    graph = _import_graph()
    assert "mindspeed_rl.workers.processes" in graph["mindspeed_rl.workers.group"], "the walk sees imports"
    cycle = _find_cycle(graph)
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def _package_graph() -> dict[str, set[str]]:
    """Top-level package (config, data, models, ...) -> the packages it imports."""
    top = lambda module: module.split(".")[1] if module.count(".") else module  # noqa: E731
    graph: dict[str, set[str]] = {}
    for module, deps in _import_graph().items():
        graph.setdefault(top(module), set()).update(top(dep) for dep in deps if top(dep) != top(module))
    return graph


def test_no_package_imports_one_that_imports_it_back():
    """The layers: errors and registries at the bottom, config on them (it validates against the features' names,
    never their implementations), and no package below importing one above (config -> data, tools -> config and
    models -> resharding were such imports)."""
    graph = _package_graph()
    cycle = _find_cycle({name: deps & set(graph) for name, deps in graph.items()})
    assert not cycle, "packages import each other: " + " -> ".join(cycle)
    assert graph["errors"] == set() and graph["registries"] <= {"errors"}
    assert "data" not in graph["config"] and "config" not in graph["tools"] and "resharding" not in graph["models"]


def test_the_walk_finds_a_cycle_when_there_is_one():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]


def test_the_worker_never_imports_fault_injection():
    graph = _import_graph()
    seen, frontier = set(), ["mindspeed_rl.workers.roles"]
    while frontier:
        node = frontier.pop()
        if node not in seen:
            seen.add(node)
            frontier += graph[node]
    assert "mindspeed_rl.workers.fault_injection" not in seen


def test_only_the_sharding_manager_moves_device_states():
    movers = []
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative in STATE_IMPLEMENTATIONS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MOVES:
                movers.append(f"{relative}:{node.lineno} .{node.func.attr}()")
    assert movers and all(m.startswith("workers/sharding_manager.py:") for m in movers), movers


def test_every_rank_group_implements_the_actor_group_protocol():
    from mindspeed_rl.workers.actor_group import ActorGroup
    from mindspeed_rl.workers.own_groups import ActorWithOwnGroups
    from mindspeed_rl.workers.disaggregated import DisaggregatedActor
    from mindspeed_rl.workers.group import RayActorGroup
    from mindspeed_rl.workers.local_group import LocalActorGroup

    methods = [name for name, member in vars(ActorGroup).items() if callable(member) and not name.startswith("_")]
    assert set(methods) >= {"initialize", "call", "start_generate", "finish_generate", "start_score", "finish_score",
                            "offload_states", "reload_states", "shutdown", "kill"}
    for group in (LocalActorGroup, RayActorGroup, DisaggregatedActor, ActorWithOwnGroups):
        for name in methods:
            expected = inspect.signature(getattr(ActorGroup, name))
            got = inspect.signature(getattr(group, name))
            assert list(got.parameters) == list(expected.parameters), (group.__name__, name, got, expected)


def test_every_rpc_of_every_part_declares_a_phase_of_the_table_or_none_by_name():
    from mindspeed_rl.memory.residency import PHASES
    from mindspeed_rl.workers.parts import declared_rpcs
    from mindspeed_rl.workers.roles import ALL_PARTS

    for part in ALL_PARTS:
        for name, rpc in declared_rpcs(part).items():
            assert getattr(rpc, "phase", None) in PHASES or getattr(rpc, "rpc", False), (part.NAME, name)
    rpcs = {name for part in ALL_PARTS for name in declared_rpcs(part)}
    assert {"generate_sequences", "compute_reward_scores", "compute_ref_log_prob", "compute_log_prob", "update",
            "save_checkpoint", "load_checkpoint", "export_hf", "load_reference_checkpoint", "switch",
            "compute_values", "update_critic"} <= rpcs


def test_every_rpc_that_takes_samples_is_split_by_the_group():
    """Ranks never slice their share of a batch or of the prompts by hand (workers/dispatch.py)."""
    import inspect

    from mindspeed_rl.workers.parts import declared_rpcs
    from mindspeed_rl.workers.roles import ALL_PARTS

    for part in ALL_PARTS:
        for name, rpc in declared_rpcs(part).items():
            takes = {"batch", "prompt_token_ids"} & set(inspect.signature(rpc).parameters)
            assert not takes or set(rpc.dispatch.arguments) >= takes, (part.NAME, name)


def _page_table(heading: str) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the first table under `heading` in docs/architecture.md."""
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    section = page.split(f"\n{heading}\n", 1)[1]
    lines = [line for line in section.split("\n\n#", 1)[0].splitlines() if line.startswith("| ")]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    return rows[0], rows[1:]


def _rpc_cell(name: str, rpc) -> str:
    """`name` (its row[, split by its dispatch mode])."""
    if not hasattr(rpc, "phase"):
        return f"`{name}`"
    return f"`{name}` ({rpc.phase}" + (f", {rpc.dispatch.mode}" if rpc.dispatch else "") + ")"


def parts_table_rows() -> list[list[str]]:
    """The parts table as the declarations give it (workers/parts/)."""
    from mindspeed_rl.workers.parts import MEGATRON, declared_rpcs
    from mindspeed_rl.workers.roles import ALL_PARTS

    rows = []
    for part in ALL_PARTS:
        rpcs = ", ".join(_rpc_cell(name, rpc) for name, rpc in declared_rpcs(part).items())
        rows.append([part.NAME, rpcs, ", ".join(sorted(part.STATES)), part.PUSH_END or "-",
                     "before the device settles" if part.STAGE == MEGATRON else "after (vLLM sizes its KV cache)",
                     ", ".join(part.BORROWS) or "-"])
    return rows


def test_the_parts_table_in_the_architecture_page_is_the_declarations():
    header, body = _page_table("## The parts of a rank")
    assert header == ["part", "RPCs (residency row)", "state groups", "push end", "built", "borrows"]
    assert body == parts_table_rows()


def test_the_residency_table_in_the_architecture_page_is_the_engines():
    from mindspeed_rl.memory.residency import IDLE, PHASES, SWITCH, ResidencyPolicy

    header, body = _page_table("## The residency table as the engine runs it")
    policy = ResidencyPolicy.offloading(has_reward_model=True, has_teacher=True, has_critic=True)
    assert [row[0] for row in body] == list(PHASES)
    for row in body:
        phase, marks, after = row[0], row[1:-1], row[-1]
        assert {state for state, mark in zip(header[1:-1], marks) if mark == "x"} == policy.resident(phase), phase
        if phase not in (IDLE, SWITCH):
            assert after == (", ".join(sorted(policy.after(phase))) or "nothing"), phase


def test_parts_are_objects_of_their_own_and_the_rank_classes_derive_from_the_rank_base_alone():
    """verl's WorkerDict: a role's rank holds one object per part and forwards the RPCs they declare; no part is a
    mixin on the rank."""
    from mindspeed_rl.workers.parts import declared_rpcs
    from mindspeed_rl.workers.rank_worker import RankWorker, compose
    from mindspeed_rl.workers.roles import ALL_PARTS

    rank_class = compose("", ALL_PARTS)
    assert rank_class.__bases__ == (RankWorker,)
    for part in ALL_PARTS:
        assert not issubclass(part, RankWorker) and not issubclass(rank_class, part), part.NAME
        for name, rpc in declared_rpcs(part).items():
            forwarded = getattr(rank_class, name)
            assert forwarded is not rpc and inspect.signature(forwarded) == inspect.signature(rpc), (part.NAME, name)
            assert getattr(forwarded, "phase", None) == getattr(rpc, "phase", None), (part.NAME, name)


def test_megatron_global_parallel_state_is_read_only_in_parallel_and_accelerator():
    """torchtitan's ParallelDims: the groups `initialize` returns are passed down; nothing reads Megatron's globals
    back but the module that sets them and the CPU compatibility layer."""
    readers = []
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith(("parallel/", "accelerator/")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "current" and \
                    isinstance(node.value, ast.Name) and node.value.id == "megatron_state":
                readers.append(f"{relative}:{node.lineno}")
    assert not readers, readers


def test_the_trainer_never_branches_on_the_rollout_kind():
    """One rollout strategy, chosen once (trainer/rollout_strategy.py): no `tool_turns is not None` in the loop."""
    branches = [f"{path.name}:{node.lineno}" for path in (PACKAGE / "trainer").rglob("*.py")
                for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.Compare) and isinstance(node.left, (ast.Name, ast.Attribute))
                and getattr(node.left, "id", getattr(node.left, "attr", "")) == "tool_turns"]
    assert not branches, branches


def test_train_takes_the_prepared_run_in_at_most_eight_parameters():
    from mindspeed_rl.trainer.grpo_trainer import train

    parameters = list(inspect.signature(train).parameters)
    assert len(parameters) <= 8 and parameters[:3] == ["config", "actor_group", "run"], parameters


def test_no_cli_changes_another_modules_globals_or_the_import_path():
    """The three training CLIs call one launch(stage, default_config); none assigns to another module's names or
    inserts into sys.path."""
    offences = []
    for path in (PACKAGE.parent / "cli").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            offences += [f"{path.name}:{node.lineno}" for target in targets
                         if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                         and target.value.id != "self"]
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "insert" \
                    and ast.unparse(node.func.value) == "sys.path":
                offences.append(f"{path.name}:{node.lineno} sys.path.insert")
    assert not offences, offences
