"""The built-in trackers other than TensorBoard and W&B (those are in test_tracking.py).

For each package that is installed, a tiny model trains for a few steps through a real
Accelerator that logs with that tracker in the package's own offline/local mode, and the test
reads back what the package wrote (MLflow's client on a file store, Comet's offline zip,
ClearML's offline session folder). A package that is not installed skips its test, naming the
extra that installs it (none is in the ``test`` extra: ``pip install 'hasten[mlflow]'`` etc.).
Every name also has a test of the error when its package is missing (the import made to fail),
which runs everywhere. Nothing here reaches the network: each test sets the package's
offline switches and points its files into tmp_path.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import zipfile

import pytest
import torch

from hasten import Accelerator, tracking

# log_with name -> (class, package, extra)
BACKENDS = {
    "tensorboard": (tracking.TensorBoardTracker, "tensorboard", "tracking"),
    "wandb": (tracking.WandBTracker, "wandb", "wandb"),
    "mlflow": (tracking.MLflowTracker, "mlflow", "mlflow"),
    "comet_ml": (tracking.CometMLTracker, "comet_ml", "comet_ml"),
    "clearml": (tracking.ClearMLTracker, "clearml", "clearml"),
    "aim": (tracking.AimTracker, "aim", "aim"),
    "dvclive": (tracking.DVCLiveTracker, "dvclive", "dvclive"),
    "swanlab": (tracking.SwanLabTracker, "swanlab", "swanlab"),
    "trackio": (tracking.TrackioTracker, "trackio", "trackio"),
}


def needs(package: str, extra: str):
    """Skip unless ``package`` is installed; the reason names the extra."""
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"the {package!r} package is not installed (pip install 'hasten[{extra}]')")
    return importlib.import_module(package)


@pytest.fixture
def process_hooks(monkeypatch):
    """Put back what a tracking package hooks into this process when it is imported or starts a run
    (Comet adds an import finder and an excepthook, ClearML wraps sys.exit), so later tests see none."""
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(sys, "exit", sys.exit)
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    yield
    for signum, handler in handlers.items():
        signal.signal(signum, handler)
    # Comet's finder patches modules imported after it; other finders added meanwhile (six's) must stay.
    sys.meta_path[:] = [finder for finder in sys.meta_path if not type(finder).__module__.startswith("comet_ml")]


def train_and_log(accelerator: Accelerator, project: str, config: dict, init_kwargs: dict, extra=None) -> list[dict]:
    """Three SGD steps of a tiny model, each step's values logged at steps 1..3; returns what was logged."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.init_trackers(project, config=config, init_kwargs=init_kwargs)
    logged = []
    for step in (1, 2, 3):
        x, y = torch.randn(8, 4), torch.randn(8, 1)
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        values = {"train_loss": loss.item(), "eval_loss": loss.item() / 2, "lr": optimizer.param_groups[0]["lr"]}
        accelerator.log({**values, **(extra or {})}, step=step)
        logged.append(values)
    return logged


# ---------------------------------------------------------------------- a missing package
@pytest.mark.parametrize("name", list(BACKENDS))
def test_a_missing_package_is_an_error_naming_the_extra(name, monkeypatch, tmp_path):
    cls, package, extra = BACKENDS[name]
    monkeypatch.setitem(sys.modules, package, None)  # `import package` fails, find_spec finds nothing
    monkeypatch.setattr(tracking, "_WARNED", set())
    hint = f"needs the '{package}' package: pip install 'hasten\\[{extra}\\]'"
    # Named in log_with: left out, the run goes on (as Accelerate), with one warning naming the install
    with pytest.warns(UserWarning, match=f"log_with='{name}'\\): the '{package}' package is not installed"):
        assert Accelerator(log_with=name, project_dir=tmp_path)._trackers.entries == []
    assert Accelerator(log_with=tracking.LoggerType(name), project_dir=tmp_path)._trackers.entries == []
    assert name not in tracking.get_available_trackers()
    assert name not in Accelerator(log_with="all", project_dir=tmp_path)._trackers.entries  # "all": installed only
    # A tracker built by hand fails when init_trackers starts it, with the same hint.
    instance = cls("proj", str(tmp_path)) if cls.requires_logging_directory else cls("proj")
    accelerator = Accelerator(log_with=[instance])
    with pytest.raises(ImportError, match=f"{cls.__name__} {hint}"):
        accelerator.init_trackers("proj")


def test_every_accelerate_name_has_a_tracker():
    assert sorted(tracking.LOGGER_TYPE_TO_CLASS) == sorted(BACKENDS)
    assert sorted(tracking.LoggerType.list()) == sorted([*BACKENDS, "all"])
    for name, (cls, _, _) in BACKENDS.items():
        assert tracking.LOGGER_TYPE_TO_CLASS[name] is cls and cls.name == name
        assert cls.requires_logging_directory is (name in ("tensorboard", "aim"))
        if importlib.util.find_spec(BACKENDS[name][1]) is not None:
            assert Accelerator(log_with=tracking.LoggerType(name), project_dir="unused")._trackers.entries == [name]


def test_no_tracker_package_is_imported_before_init_trackers():
    """hasten.tracking and Accelerator(log_with=...) only look the packages up; start() imports them."""
    packages = sorted({package for _, package, _ in BACKENDS.values()} | {"torch.utils.tensorboard"})
    code = (
        "import sys, hasten, hasten.tracking\n"
        "from hasten import Accelerator\n"
        "Accelerator(log_with='all', project_dir='unused')\n"
        f"print(sorted(m for m in {packages!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["[]"], out.stdout


# ---------------------------------------------------------------------- MLflow
def test_mlflow_tracker_arguments_give_way_to_the_environment(monkeypatch):
    t = tracking.MLflowTracker("exp", logging_dir="art", run_id=None, tags={"a": "1"}, nested_run=False, run_name="r")
    assert (t.experiment_name, t.logging_dir, t.tags, t.nested_run, t.run_name) == (
        "exp",
        "art",
        {"a": "1"},
        False,
        "r",
    )
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    monkeypatch.setenv("MLFLOW_RUN_ID", "abc")
    monkeypatch.setenv("MLFLOW_TAGS", '{"team": "x"}')
    monkeypatch.setenv("MLFLOW_NESTED_RUN", "false")
    t = tracking.MLflowTracker("exp", tags={"a": "1"}, nested_run=True)
    assert (t.experiment_name, t.run_id, t.tags, t.nested_run) == ("from-env", "abc", {"team": "x"}, False)
    monkeypatch.setenv("MLFLOW_TAGS", "not json")
    with pytest.raises(ValueError, match="MLflowTracker.tags \\(or MLFLOW_TAGS\\) must be a dict or its JSON text"):
        tracking.MLflowTracker("exp")


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    mlflow = needs("mlflow", "mlflow")
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses a file store unless told
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("DO_NOT_TRACK", "true")
    for var in ("MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID", "MLFLOW_TAGS", "MLFLOW_NESTED_RUN"):
        monkeypatch.delenv(var, raising=False)
    yield mlflow.tracking.MlflowClient(tracking_uri=uri)
    while mlflow.active_run() is not None:  # a failed test leaves no run open for the next one
        mlflow.end_run()


def test_mlflow_log_kwargs_reach_log_metrics(mlflow_store, monkeypatch, process_hooks):
    """Accelerator.log(log_kwargs={"mlflow": ...}) goes on to mlflow.log_metrics, as in Accelerate."""
    import mlflow

    calls = []
    monkeypatch.setattr(mlflow, "log_metrics", lambda metrics, **kw: calls.append((metrics, kw)))
    accelerator = Accelerator(log_with="mlflow")
    accelerator.init_trackers("hasten-kwargs")
    accelerator.log({"loss": 0.5}, step=3, log_kwargs={"mlflow": {"synchronous": True}})
    accelerator.end_training()
    assert calls == [({"loss": 0.5}, {"step": 3, "synchronous": True})]


def test_mlflow_file_store_holds_the_metrics_and_params(mlflow_store, tmp_path, caplog, process_hooks):
    import mlflow
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    accelerator = Accelerator(log_with="mlflow")
    config = {"lr": 0.1, "layers": [4, 1], "too_long": "x" * (MAX_PARAM_VAL_LENGTH + 1)}
    init_kwargs = {
        "mlflow": {
            "run_name": "r1",
            "tags": {"team": "hasten"},
            "description": "tiny",
            "logging_dir": str(tmp_path / "artifacts"),
        }
    }
    with caplog.at_level(logging.WARNING, logger="hasten.tracking"):
        logged = train_and_log(
            accelerator, "hasten-exp", config, init_kwargs, extra={"note": "a string", "acc": torch.tensor(0.75)}
        )
        run = accelerator.get_tracker("mlflow", unwrap=True)
        assert isinstance(run, mlflow.ActiveRun) and mlflow.active_run().info.run_id == run.info.run_id
        accelerator.end_training()
    assert mlflow.active_run() is None  # end_training ended the run
    assert "'note' is a str, not logged" in caplog.text and "'too_long' is a str, not logged" in caplog.text
    assert config["too_long"]  # the caller's dict is left as it was

    experiment = mlflow_store.get_experiment_by_name("hasten-exp")  # init_trackers' project name
    assert experiment.artifact_location.endswith("artifacts")
    runs = mlflow_store.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    stored = runs[0]
    assert stored.info.run_name == "r1" and stored.info.status == "FINISHED"
    assert stored.data.params == {"lr": "0.1", "layers": "[4, 1]"}
    assert stored.data.tags["team"] == "hasten" and stored.data.tags["mlflow.note.content"] == "tiny"
    for key in ("train_loss", "eval_loss", "lr"):
        history = sorted((m.step, m.value) for m in mlflow_store.get_metric_history(stored.info.run_id, key))
        assert history == [(step, pytest.approx(values[key])) for step, values in zip((1, 2, 3), logged)]
    assert [(m.step, m.value) for m in mlflow_store.get_metric_history(stored.info.run_id, "acc")] == [
        (1, 0.75),
        (2, 0.75),
        (3, 0.75),
    ]
    assert "note" not in stored.data.metrics

    # A second run of the same project goes into the same experiment; run_id resumes the first run.
    accelerator = Accelerator(log_with="mlflow")
    accelerator.init_trackers("hasten-exp")
    accelerator.log({"train_loss": 1.0}, step=7)
    accelerator.end_training()
    assert len(mlflow_store.search_runs([experiment.experiment_id])) == 2
    accelerator = Accelerator(log_with="mlflow")
    accelerator.init_trackers("hasten-exp", init_kwargs={"mlflow": {"run_id": stored.info.run_id}})
    accelerator.log({"train_loss": 2.0}, step=4)
    accelerator.end_training()
    assert len(mlflow_store.search_runs([experiment.experiment_id])) == 2
    history = sorted((m.step, m.value) for m in mlflow_store.get_metric_history(stored.info.run_id, "train_loss"))
    assert [step for step, _ in history] == [1, 2, 3, 4] and history[-1] == (4, 2.0)


# ---------------------------------------------------------------------- Comet
def _comet_messages(folder) -> list[dict]:
    archives = glob.glob(os.path.join(folder, "*.zip"))
    assert len(archives) == 1, archives
    with zipfile.ZipFile(archives[0]) as archive:
        experiment = json.loads(archive.read("experiment.json"))
        lines = archive.read("messages.json").decode().splitlines()
    return experiment, [json.loads(line) for line in lines if line.strip()]


def test_comet_offline_archive_holds_the_metrics_params_and_others(tmp_path, monkeypatch, process_hooks):
    comet_ml = needs("comet_ml", "comet_ml")
    offline = tmp_path / "comet"
    monkeypatch.setenv("COMET_OFFLINE_DIRECTORY", str(offline))
    monkeypatch.setenv("COMET_DISABLE_AUTO_LOGGING", "1")
    for var in ("COMET_API_KEY", "COMET_START_ONLINE", "COMET_EXPERIMENT_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    experiment_config = comet_ml.ExperimentConfig(
        name="r1", log_code=False, log_git_metadata=False, log_git_patch=False, log_env_details=False
    )
    accelerator = Accelerator(log_with="comet_ml")
    logged = train_and_log(
        accelerator,
        "hasten-proj",
        {"lr": 0.1, "depth": 2},
        {"comet_ml": {"online": False, "experiment_config": experiment_config}},
        extra={"note": "a string", "group": {"g_a": 1.5}},
    )
    writer = accelerator.get_tracker("comet_ml", unwrap=True)
    assert isinstance(writer, comet_ml.OfflineExperiment)
    accelerator.end_training()

    experiment, messages = _comet_messages(offline)
    assert experiment["project_name"] == "hasten-proj"
    metrics: dict[str, list] = {}
    params, others = {}, {}
    for message in messages:
        payload = message["payload"]
        if message["type"] == "metric_msg":
            metric = payload["metric"]
            metrics.setdefault(metric["metricName"], []).append((metric["step"], metric["metricValue"]))
        elif message["type"] == "parameter_msg":
            params[payload["param"]["paramName"]] = payload["param"]["paramValue"]
        elif message["type"] == "log_other":
            others[payload["key"]] = payload["value"]
    for key in ("train_loss", "eval_loss", "lr"):
        assert metrics[key] == [(step, pytest.approx(values[key])) for step, values in zip((1, 2, 3), logged)]
    assert metrics["g_a"] == [(1, 1.5), (2, 1.5), (3, 1.5)]  # a dict of numbers: log_metrics at the step
    assert params["lr"] == 0.1 and params["depth"] == 2
    assert params["curr_step"] == 3  # log() set the step before logging
    assert others["note"] == "a string" and others["Name"] == "r1"


# ---------------------------------------------------------------------- ClearML
def test_clearml_offline_session_holds_the_scalars_and_configuration(tmp_path, monkeypatch, process_hooks):
    clearml = needs("clearml", "clearml")
    config_file = tmp_path / "clearml.conf"
    cache = tmp_path / "clearml-cache"
    # No reporting subprocess (its shutdown waits ~10 s); the offline session goes under tmp_path.
    config_file.write_text(
        "sdk {\n  development { report_use_subprocess: false }\n"
        f'  storage {{ cache {{ default_base_dir: "{cache}" }} }}\n}}\n'
    )
    monkeypatch.setenv("CLEARML_CONFIG_FILE", str(config_file))
    monkeypatch.setenv("HOME", str(tmp_path))
    for var in ("CLEARML_PROJECT", "CLEARML_TASK", "CLEARML_API_HOST", "CLEARML_WEB_HOST", "CLEARML_FILES_HOST"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("CLEARML_OFFLINE_MODE", raising=False)  # set_offline sets it; put back at teardown
    # Offline stays on for the rest of the process: going back online needs a configured server.
    clearml.Task.set_offline(True)
    accelerator = Accelerator(log_with="clearml")
    init_kwargs = {
        "clearml": {
            "auto_connect_frameworks": False,
            "auto_resource_monitoring": False,
            "auto_connect_streams": False,
            "auto_connect_arg_parser": False,
        }
    }
    logged = train_and_log(accelerator, "hasten-proj", {"lr": 0.1, "depth": 2}, init_kwargs, extra={"note": "a string"})
    accelerator.log({"final_loss": 0.125})  # no step: a single value
    task = accelerator.get_tracker("clearml", unwrap=True)
    assert isinstance(task, clearml.Task)
    assert task.get_project_name() == "hasten-proj" and task.name == "hasten-proj"
    folder = task.get_offline_mode_folder()
    accelerator.end_training()
    assert clearml.Task.current_task() is None  # end_training closed the task it started
    assert str(folder).startswith(str(cache))

    reports = []
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        for line in f:
            if line.strip():
                batch = json.loads(line)
                reports.extend(batch if isinstance(batch, list) else [batch])
    scalars: dict[tuple[str, str], list] = {}
    for report in reports:
        if report.get("type") == "training_stats_scalar":
            scalars.setdefault((report["metric"], report["variant"]), []).append((report["iter"], report["value"]))
    # eval_/train_ prefixes become the series; a key without one is a "train" series of its own title.
    assert scalars[("loss", "train")] == [(s, pytest.approx(v["train_loss"])) for s, v in zip((1, 2, 3), logged)]
    assert scalars[("loss", "eval")] == [(s, pytest.approx(v["eval_loss"])) for s, v in zip((1, 2, 3), logged)]
    assert scalars[("lr", "train")] == [(1, 0.1), (2, 0.1), (3, 0.1)]
    assert [v for (_, variant), values in scalars.items() if variant == "final_loss" for _, v in values] == [0.125]
    assert not any("note" in key for pair in scalars for key in pair)  # a string is not a scalar
    with open(os.path.join(folder, "task.json")) as f:
        stored_task = json.load(f)
    general = stored_task["configuration"]["General"]  # connect_configuration's default section
    assert general["type"] == "dictionary" and general["value"].splitlines() == ["lr = 0.1", "depth = 2"]
    assert stored_task["project_name"] == "hasten-proj" and stored_task["name"] == "hasten-proj"

    # A task the script started itself is used as it is, and left open by end_training.
    own = clearml.Task.init(project_name="own", task_name="own-task", **init_kwargs["clearml"])
    accelerator = Accelerator(log_with="clearml")
    accelerator.init_trackers("not-used")
    accelerator.log({"loss": 1.0}, step=1)
    assert accelerator.get_tracker("clearml", unwrap=True) is own
    accelerator.end_training()
    assert clearml.Task.current_task() is own
    own.close()


# ---------------------------------------------------------------------- trackio
def test_trackio_local_database_holds_the_metrics_and_config(tmp_path, monkeypatch, process_hooks):
    if importlib.util.find_spec("trackio") is None:
        pytest.skip("the 'trackio' package is not installed (pip install 'hasten[trackio]')")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))  # read when trackio is first imported
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("TRACKIO_SPACE_ID", raising=False)
    import trackio

    project = f"hasten-{tmp_path.name}"  # its own database, wherever trackio keeps them
    accelerator = Accelerator(log_with="trackio")
    init_kwargs = {"trackio": {"name": "r1", "auto_log_cpu": False, "auto_log_gpu": False, "embed": False}}
    logged = train_and_log(accelerator, project, {"lr": 0.1, "depth": 2}, init_kwargs)
    assert isinstance(accelerator.get_tracker("trackio", unwrap=True), trackio.Run)
    accelerator.end_training()

    rows = trackio.SQLiteStorage.get_logs(project, "r1")
    for key in ("train_loss", "eval_loss", "lr"):
        assert [(row["step"], row[key]) for row in rows] == [
            (s, pytest.approx(v[key])) for s, v in zip((1, 2, 3), logged)
        ]
    (run,) = list(trackio.Api().runs(project))
    assert run.name == "r1" and run.config["lr"] == 0.1 and run.config["depth"] == 2
    assert "allow_val_change" not in run.config


# ---------------------------------------------------------------------- SwanLab
def test_swanlab_offline_run_file_holds_the_scalars_and_config(tmp_path, monkeypatch, process_hooks):
    swanlab = needs("swanlab", "swanlab")
    import yaml

    logs = tmp_path / "swanlog"
    monkeypatch.chdir(tmp_path)
    accelerator = Accelerator(log_with="swanlab")
    init_kwargs = {"swanlab": {"mode": "offline", "log_dir": str(logs), "name": "r1"}}
    logged = train_and_log(accelerator, "hasten-proj", {"lr": 0.1, "depth": 2}, init_kwargs)
    run = accelerator.get_tracker("swanlab", unwrap=True)
    assert run is not None and run is swanlab.get_run()
    accelerator.end_training()

    (run_file,) = glob.glob(str(logs / "run-*" / "run-*.swanlab"))
    # The run file is a log of protobuf records; SwanLab's own reader and record type read it.
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    reader = DataStoreReader()
    reader.open(run_file)
    scalars: dict[str, list] = {}
    start = None
    for data in reader:
        record = Record()
        record.ParseFromString(data)
        if record.HasField("start"):
            start = record.start
        if record.HasField("scalar"):
            scalars.setdefault(record.scalar.key, []).append((record.scalar.step, record.scalar.value.number))
    reader.close()
    assert start.project == "hasten-proj" and start.name == "r1"
    for key in ("train_loss", "eval_loss", "lr"):
        assert scalars[key] == [(s, pytest.approx(v[key])) for s, v in zip((1, 2, 3), logged)]
    (config_file,) = glob.glob(str(logs / "run-*" / "files" / "config.yaml"))
    config = yaml.safe_load(open(config_file))
    assert config["lr"]["value"] == 0.1 and config["depth"]["value"] == 2 and "allow_val_change" not in config


# ---------------------------------------------------------------------- DVCLive
def test_dvclive_files_hold_the_metrics_and_params(tmp_path, monkeypatch, caplog, process_hooks):
    needs("dvclive", "dvclive")
    import yaml

    monkeypatch.setenv("DVC_NO_ANALYTICS", "1")
    monkeypatch.chdir(tmp_path)  # not inside a Git or DVC repository
    out = tmp_path / "live"
    accelerator = Accelerator(log_with="dvclive")
    logged = train_and_log(
        accelerator,
        "ignored-by-dvclive",
        {"lr": 0.1, "layers": [4, 1]},
        {"dvclive": {"dir": str(out), "save_dvc_exp": False}},
        extra={"acc": torch.tensor(0.75), "group": {"a": 1.0}},
    )
    live = accelerator.get_tracker("dvclive", unwrap=True)
    assert live.dir == str(out)
    assert "'group' is a dict, not logged" in caplog.text
    accelerator.end_training()

    for key in ("train_loss", "eval_loss", "lr"):
        with open(out / "plots" / "metrics" / f"{key}.tsv") as f:
            header, *rows = [line.rstrip("\n").split("\t") for line in f if line.strip()]
        assert header == ["step", key]
        assert [(int(s), float(v)) for s, v in rows] == [(s, pytest.approx(v[key])) for s, v in zip((1, 2, 3), logged)]
    assert (out / "plots" / "metrics" / "acc.tsv").read_text().split() == [
        "step",
        "acc",
        "1",
        "0.75",
        "2",
        "0.75",
        "3",
        "0.75",
    ]
    assert not (out / "plots" / "metrics" / "group.tsv").exists()  # a dict is not a metric: left out, with a warning
    assert yaml.safe_load((out / "params.yaml").read_text()) == {"lr": 0.1, "layers": [4, 1]}
    summary = json.loads((out / "metrics.json").read_text())
    assert summary["step"] == 3 and summary["train_loss"] == pytest.approx(logged[-1]["train_loss"])


# ---------------------------------------------------------------------- Aim
def test_aim_repository_holds_the_metrics_and_hparams(tmp_path, monkeypatch, process_hooks):
    aim = needs("aim", "aim")
    monkeypatch.setenv("AIM_UI_TELEMETRY_ENABLED", "0")
    monkeypatch.chdir(tmp_path)
    project = tmp_path / "project"  # the logging directory: AimTracker's repository
    project.mkdir()
    accelerator = Accelerator(log_with="aim", project_dir=project)
    init_kwargs = {
        "aim": {"system_tracking_interval": None, "capture_terminal_logs": False, "log_system_params": False}
    }
    logged = train_and_log(accelerator, "r1", {"lr": 0.1, "depth": 2}, init_kwargs)
    run = accelerator.get_tracker("aim", unwrap=True)
    assert isinstance(run, aim.Run) and run.name == "r1"
    run_hash = run.hash
    accelerator.end_training()

    # A closed run is read through the repository's index, which Aim's own CLI rebuilds.
    reindex = "import sys; from aim.cli.cli import cli_entry_point; sys.exit(cli_entry_point())"
    subprocess.run(
        [sys.executable, "-c", reindex, "storage", "--repo", str(project), "reindex", "-y"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    (stored,) = [r for r in aim.Repo.from_path(str(project)).iter_runs() if r.hash == run_hash]
    assert stored.name == "r1" and stored["hparams"] == {"lr": 0.1, "depth": 2}
    tracked = {}
    for metric in stored.metrics():
        steps, (values, *_) = metric.data.items_list()
        tracked[metric.name] = list(zip(steps, values))
    for key in ("train_loss", "eval_loss", "lr"):
        assert tracked[key] == [(s, pytest.approx(v[key])) for s, v in zip((1, 2, 3), logged)]
