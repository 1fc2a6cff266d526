"""Test scaffolding: the scalars SwanLab and MLflow wrote, read back from their files as {step: {key: value}}.

SwanLab's offline run (`<logdir>/run-*/run-<id>.swanlab`) is the same LevelDB-style log as wandb's run file
(tests/wandb_reader.py), each record a `swanlab.record.v1.Record`; it is read with swanlab's own reader of that
file (what `swanlab sync` uploads from). MLflow's runs are read with MLflow's client from the store they went to (by default the run dir's SQLite
database).
"""
from pathlib import Path

SWANLAB_SYSTEM = "__swanlab__."


def swanlab_scalars(log_dir: Path) -> dict[int, dict[str, float]]:
    """Every scalar of the one offline run under `log_dir`, once its finish record is on disk."""
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    (run_file,) = log_dir.glob("run-*/run-*.swanlab")
    reader = DataStoreReader()
    reader.open(run_file)
    try:
        records = []
        for data in reader:
            record = Record()
            record.ParseFromString(data)
            records.append(record)
    finally:
        reader.close()
    kinds = [record.WhichOneof("record_type") for record in records]
    assert "finish" in kinds, f"{run_file} has no finish record: {kinds}"
    steps: dict[int, dict[str, float]] = {}
    for record in records:
        # `__swanlab__.*`: swanlab's own system monitor (CPU, memory), counted in steps of its own
        if record.WhichOneof("record_type") == "scalar" and not record.scalar.key.startswith(SWANLAB_SYSTEM):
            steps.setdefault(record.scalar.step, {})[record.scalar.key] = record.scalar.value.number
    return steps


def mlflow_scalars(tracking_uri: str, *, experiment: str, run_name: str) -> dict[int, dict[str, float]]:
    """Every metric of the one finished run `run_name` in `experiment`, each at every step it was logged."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id],
                                filter_string=f"attributes.run_name = '{run_name}'")
    assert run.info.status == "FINISHED", run.info
    steps: dict[int, dict[str, float]] = {}
    for key in run.data.metrics:
        for metric in client.get_metric_history(run.info.run_id, key):
            steps.setdefault(metric.step, {})[key] = metric.value
    return steps
