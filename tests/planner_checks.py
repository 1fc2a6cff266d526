"""The planner's predicted bytes against the ledger's measured ones, in one metrics.jsonl record."""
LEDGER_PHASES = ("generate", "ref_logprob", "old_logprob", "update")
STATE_CATEGORIES = ("train_params", "train_grads", "optimizer_states", "reference_params", "inference_weights",
                    "kv_cache")


def prediction_errors(record: dict) -> dict[str, float]:
    """`memory/<phase>/<category>` -> |predicted - measured| / measured (0 when both are 0; inf when only the
    prediction is)."""
    errors = {}
    for phase in LEDGER_PHASES:
        categories = STATE_CATEGORIES + (("activations",) if phase == "update" else ())
        for category in categories:
            measured = record[f"memory/{phase}/{category}_bytes"]
            predicted = record[f"memory/{phase}/{category}_predicted_bytes"]
            if measured == predicted:
                errors[f"{phase}/{category}"] = 0.0
            else:
                errors[f"{phase}/{category}"] = abs(predicted - measured) / measured if measured else float("inf")
    return errors


def assert_prediction_matches_ledger(record: dict, *, tolerance: float = 0.10,
                                     activations_tolerance: float = 0.30) -> dict[str, float]:
    """Every category within `tolerance` of the ledger, activations within `activations_tolerance`; returns the
    largest error per category (for the report)."""
    errors = prediction_errors(record)
    worst: dict[str, float] = {}
    for key, error in errors.items():
        category = key.split("/")[1]
        limit = activations_tolerance if category == "activations" else tolerance
        assert error <= limit, (f"{key}: predicted {record[f'memory/{key}_predicted_bytes']:.0f} vs measured "
                                f"{record[f'memory/{key}_bytes']:.0f} ({error:.1%} > {limit:.0%})")
        worst[category] = max(worst.get(category, 0.0), error)
    for phase in LEDGER_PHASES:
        assert record[f"memory/{phase}/predicted_bytes"] > 0
    return worst


def assert_host_prediction_matches_ledger(record: dict, *, phase: str = "after_update",
                                          tolerance: float = 0.10) -> None:
    """The planner's host bytes per state (`memory/host/<state>_predicted_bytes`: the offloaded states' mirrors, LoRA's
    backbone copy) against the ledger's at `phase` (`memory/<phase>/host/<state>_bytes`), each within `tolerance`.
    After the update every state that leaves the device has left once (the optimizer's appear at its first step)."""
    predicted = {key.removeprefix("memory/host/").removesuffix("_predicted_bytes"): value
                 for key, value in record.items() if key.startswith("memory/host/")}
    assert predicted, "the planner's host bytes are in the record"
    for state, value in predicted.items():
        measured = record.get(f"memory/{phase}/host/{state}_bytes", 0.0)
        assert abs(value - measured) <= tolerance * max(measured, 1.0), (
            f"host {state}: predicted {value:.0f} vs measured {measured:.0f}")
