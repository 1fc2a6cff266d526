"""Every run a user can write either runs or is refused at start (issue 54): the all-pairs cases of
tests/run_combinations.py (algorithm x placement x layout x one-step off-policy x the mismatch ledger x rollout
correction x LoRA x packing x partial rollout x the swap optimizer x evaluation x a reward model x a device capacity x
on-policy distillation),
each through its CLI for 2 iterations: it finishes with both records, or exits 2 with `config error: <key>: <why>`
lines and nothing started, never a traceback. docs/testing.md lists the cases and their verdicts.

Runs where: one CLI run per case (1-6 rank processes; those that need Ray join one cluster the module starts, through
Ray's RAY_ADDRESS; real Megatron + vLLM);
`make test-run-combinations`, which .ci/run calls.
"""
import json

import pytest

from cli_runner import run_cli
from run_combinations import STUDENT_CHECKPOINT, cases, command
from two_nodes import one_node

pytestmark = pytest.mark.run_combinations


def pytest_generate_tests(metafunc):
    """The cases are generated under the config's own checks (about 300 config loads, ~30 s): only where this
    module's marker is asked for (`make test-run-combinations`), not at every collection of `make test`."""
    if "case" not in metafunc.fixturenames:
        return
    selected = "run_combinations" in metafunc.config.getoption("markexpr") and \
        "not run_combinations" not in metafunc.config.getoption("markexpr")
    generated = cases() if selected else []
    metafunc.parametrize("case, refusal", generated, ids=[_label(case) for case, _ in generated])


@pytest.fixture(scope="module")
def ray_address(tmp_path_factory):
    with one_node(tmp_path_factory.mktemp("combinations_ray"), num_cpus=8) as address:
        yield address


def _label(case: dict) -> str:
    return "-".join(str(value) if not isinstance(value, bool) else name for name, value in case.items()
                    if value not in (False, "none"))


def _student_checkpoint(config_name: str, assets) -> str:
    """The case's generated demo checkpoint, made here first (the run then finds it made)."""
    from test_config import load

    from mindspeed_rl.trainer import setup

    return setup.resolve_assets(load(config_name, f"synthetic_data.data_dir={assets}"))[0]


def test_the_run_finishes_or_is_refused_at_start(tmp_path, ray_address, case, refusal):
    """`refusal`: the config error lines the config's checks give in-process, None where it loads; the CLI must agree:
    exit 2 with exactly those lines and nothing started, or both iterations recorded."""
    script, name, overrides = command(case)
    assets = tmp_path / "assets"
    overrides = [o.replace(STUDENT_CHECKPOINT, _student_checkpoint(name, assets)) if STUDENT_CHECKPOINT in o else o
                 for o in overrides]
    # Ray's RAY_ADDRESS, not runtime.ray_address: a one-rank case then runs in the CLI's process, as a user's does.
    done = run_cli(tmp_path, name, *overrides, f"synthetic_data.data_dir={assets}", script=script, timeout=420,
                   env={"RAY_ADDRESS": ray_address})
    output = done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr, output
    metrics = tmp_path / "run" / "metrics.jsonl"
    if refusal is not None:
        errors = [line for line in done.stderr.splitlines() if line.startswith("config error: ")]
        assert done.returncode == 2 and "\n".join(errors) == refusal and not metrics.exists(), output
        return
    assert done.returncode == 0, output
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in records if "reward/mean" in r] == [1, 2], output
