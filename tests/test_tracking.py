"""Trackers on one process: TensorBoard event files hold what was logged, custom trackers get
every call, wandb offline, and the refusals at Accelerator(...). Rank-0-only logging on 2
processes is checked in test_parity.py (one launch of scripts/parity_checks.py)."""

from __future__ import annotations

import glob
import importlib.util
import os
import time

import pytest
import torch

from hasten import Accelerator, GeneralTracker, LoggerType, ProjectConfiguration, tracking


class Recorder(GeneralTracker):
    """A custom tracker that remembers every call."""

    name = "recorder"
    requires_logging_directory = False

    def __init__(self, main_process_only: bool = True):
        super().__init__()
        self.main_process_only = main_process_only
        self.calls: list[tuple] = []

    @property
    def tracker(self):
        return self.calls

    def start(self):
        self.calls.append(("start",))

    def store_init_configuration(self, values):
        self.calls.append(("config", dict(values)))

    def log(self, values, step=None, **kwargs):
        self.calls.append(("log", dict(values), step, kwargs))

    def finish(self):
        self.calls.append(("finish",))


def read_events(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def test_tensorboard_event_files_hold_the_logged_values(tmp_path):
    pytest.importorskip(
        "tensorboard", reason="the tensorboard package is not installed (pip install 'hasten[tracking]')"
    )
    accelerator = Accelerator(log_with="tensorboard", project_dir=tmp_path)
    accelerator.init_trackers("exp", config={"lr": 0.1, "layers": [4, 2], "name": "small", "warmup": None})
    accelerator.log({"loss": 0.5, "acc": torch.tensor(0.75), "note": "first"}, step=1)
    accelerator.log({"loss": 0.25, "group": {"a": 1.0, "b": 2}}, step=2)
    writer = accelerator.get_tracker("tensorboard", unwrap=True)
    assert isinstance(writer, torch.utils.tensorboard.SummaryWriter)
    assert accelerator.get_tracker("tensorboard").logging_dir == os.path.join(str(tmp_path), "exp")
    accelerator.end_training()

    events = read_events(tmp_path / "exp")
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 0.5), (2, 0.25)]
    assert [(e.step, e.value) for e in events.Scalars("acc")] == [(1, 0.75)]
    assert "note/text_summary" in events.Tags()["tensors"]
    assert events.PluginTagToContent("hparams"), "the configuration was written for the HParams tab"
    groups = sorted(os.listdir(tmp_path / "exp"))  # add_scalars writes one sub-run per key
    assert "group_a" in groups and "group_b" in groups
    assert [e.value for e in read_events(tmp_path / "exp" / "group_b").Scalars("group")] == [2.0]
    # finished, and still listed (as in Accelerate: a script may read a tracker's files after end_training)
    assert [t.name for t in accelerator.trackers] == ["tensorboard"]
    finished = []
    accelerator.trackers[0].finish = lambda: finished.append(True)
    accelerator.end_training()  # a second end_training finishes nothing again
    assert finished == []


def test_logging_dir_of_the_project_configuration(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard package is not installed")
    config = ProjectConfiguration(project_dir=tmp_path / "project", logging_dir=tmp_path / "logs")
    accelerator = Accelerator(log_with=LoggerType.TENSORBOARD, project_config=config)
    accelerator.init_trackers("run")
    accelerator.log({"x": 1.0}, step=0)
    accelerator.end_training()
    assert glob.glob(str(tmp_path / "logs" / "run" / "events.out.tfevents.*"))
    assert not (tmp_path / "project").exists()


def test_custom_tracker_receives_config_log_and_finish():
    recorder = Recorder()
    accelerator = Accelerator(log_with=[recorder])
    assert type(accelerator.get_tracker("recorder")) is GeneralTracker  # before init_trackers: a do-nothing one
    accelerator.init_trackers("proj", config={"lr": 0.1})
    accelerator.log({"loss": 1.5}, step=3, log_kwargs={"recorder": {"commit": False}, "other": {"x": 1}})
    accelerator.log({"loss": 1.0})
    assert accelerator.trackers == [recorder]
    assert accelerator.get_tracker("recorder") is recorder
    assert accelerator.get_tracker("recorder", unwrap=True) is recorder.calls
    with pytest.raises(ValueError, match="get_tracker\\('wandb'\\): no such tracker.*\\['recorder'\\]"):
        accelerator.get_tracker("wandb")
    accelerator.end_training()
    assert recorder.calls == [
        ("start",),
        ("config", {"lr": 0.1}),
        ("log", {"loss": 1.5}, 3, {"commit": False}),
        ("log", {"loss": 1.0}, None, {}),
        ("finish",),
    ]


def test_a_main_process_only_tracker_does_nothing_elsewhere(monkeypatch):
    """On a process other than the main one, main-process-only trackers are neither started nor logged to."""
    main_only, everywhere = Recorder(), Recorder(main_process_only=False)
    everywhere.name = "everywhere"
    accelerator = Accelerator(log_with=[main_only, everywhere])
    accelerator._trackers.is_main_process = False  # as rank 1 sees it
    accelerator.init_trackers("proj", config={"a": 1})
    accelerator.log({"loss": 2.0}, step=1)
    blank = accelerator.get_tracker("recorder")
    assert blank is not main_only and blank.log({"x": 1}) is None  # a do-nothing tracker
    accelerator.end_training()
    assert main_only.calls == []
    assert [c[0] for c in everywhere.calls] == ["start", "config", "log", "finish"]


def test_on_main_process_decorator_for_tracker_methods(monkeypatch):
    class Decorated(Recorder):
        @tracking.on_main_process
        def log(self, values, step=None, **kwargs):
            super().log(values, step, **kwargs)

    tracker = Decorated()
    monkeypatch.setenv("RANK", "1")
    tracker.log({"a": 1})
    tracker.main_process_only = False
    tracker.log({"b": 2})
    monkeypatch.setenv("RANK", "0")
    tracker.main_process_only = True
    tracker.log({"c": 3})
    assert [c[1] for c in tracker.calls] == [{"b": 2}, {"c": 3}]


# log_with name -> the package it needs, in the order of Accelerate's get_available_trackers()
PACKAGES = {
    "tensorboard": "tensorboard",
    "wandb": "wandb",
    "comet_ml": "comet_ml",
    "aim": "aim",
    "mlflow": "mlflow",
    "clearml": "clearml",
    "dvclive": "dvclive",
    "swanlab": "swanlab",
    "trackio": "trackio",
}
NEEDS_LOGGING_DIR = {"tensorboard", "aim"}


def test_log_with_all_picks_the_installed_trackers(tmp_path):
    expected = [name for name, package in PACKAGES.items() if importlib.util.find_spec(package)]
    assert tracking.get_available_trackers() == expected
    recorder = Recorder()
    assert Accelerator(log_with=["all", recorder], project_dir=tmp_path)._trackers.entries == [*expected, recorder]
    # Without a logging directory, "all" leaves out the trackers that need one.
    assert Accelerator(log_with="all")._trackers.entries == [n for n in expected if n not in NEEDS_LOGGING_DIR]


def test_refusals_at_construction(monkeypatch, tmp_path):
    with pytest.raises(
        ValueError,
        match="log_with must be one of 'all', 'aim', 'tensorboard', .*'swanlab', a GeneralTracker.*got 'tensorbord'",
    ):
        Accelerator(log_with="tensorbord")
    with pytest.raises(TypeError, match="log_with takes tracker instances, got the class Recorder"):
        Accelerator(log_with=Recorder)
    with pytest.raises(TypeError, match="log_with must be .* got 5 \\(int\\)"):
        Accelerator(log_with=[5])
    if importlib.util.find_spec("tensorboard"):
        with pytest.raises(ValueError, match="Logging with `tensorboard` requires a `logging_dir`"):
            Accelerator(log_with="tensorboard")
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in ("tensorboard", "wandb") else real(name, *a)
    )
    # A tracker whose package is missing is left out, with a warning naming the install command (issue 57)
    import hasten.tracking as tracking_module

    monkeypatch.setattr(tracking_module, "_WARNED", set())
    with pytest.warns(UserWarning, match="'tensorboard' package is not installed.*pip install tensorboard"):
        assert Accelerator(log_with="tensorboard", project_dir=tmp_path)._trackers.entries == []
    with pytest.warns(UserWarning, match="'wandb' package is not installed.*pip install 'hasten\\[wandb\\]'"):
        Accelerator(log_with="wandb")

    class Incomplete(GeneralTracker):
        name = "incomplete"

    with pytest.raises(NotImplementedError, match="Incomplete lacks requires_logging_directory, tracker"):
        Incomplete()


def test_init_trackers_refuses_bad_arguments():
    accelerator = Accelerator(log_with=[Recorder()])
    with pytest.raises(TypeError, match="init_trackers.project_name must be a non-empty string"):
        accelerator.init_trackers("")
    with pytest.raises(TypeError, match="init_trackers.config must be a dict or None"):
        accelerator.init_trackers("p", config=[("lr", 1)])
    with pytest.raises(TypeError, match="init_trackers.project_name must be a non-empty string"):
        Accelerator(log_with="tensorboard", project_dir=".").init_trackers(None)


def test_init_trackers_takes_no_project_name_for_tracker_instances():
    """Accelerate's instance trackers carry their project: init_trackers(None, config) is allowed for them."""
    recorder = Recorder()
    accelerator = Accelerator(log_with=[recorder])
    accelerator.init_trackers(None, config={"lr": 0.5})
    assert recorder.calls == [("start",), ("config", {"lr": 0.5})]


def test_wandb_offline(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="wandb is not installed (pip install 'hasten[wandb]')")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(tmp_path)
    accelerator = Accelerator(log_with="wandb")
    accelerator.init_trackers(
        "hasten-test", config={"lr": 0.01}, init_kwargs={"wandb": {"dir": str(tmp_path), "name": "r1"}}
    )
    accelerator.log({"loss": 0.5}, step=1)
    accelerator.log({"loss": 0.25}, step=2)
    run = accelerator.get_tracker("wandb", unwrap=True)
    assert isinstance(run, wandb.sdk.wandb_run.Run)
    assert run.config["lr"] == 0.01 and run.name == "r1" and run.project == "hasten-test"
    accelerator.end_training()
    files = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1
    deadline = time.monotonic() + 30  # wandb's service process may still be flushing the file
    while True:
        with open(files[0], "rb") as f:
            data = f.read()
        if (b"loss" in data and b"0.25" in data) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert b"loss" in data and b"0.25" in data and b"0.5" in data  # the history is in the offline run file


# ---------------------------------------------------------------------- register_tracker_class
class _Recorder(GeneralTracker):
    name = "recorder"
    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs):
        super().__init__()
        self.run_name, self.kwargs, self.config, self.values = run_name, kwargs, {}, {}

    @property
    def tracker(self):
        return self

    def store_init_configuration(self, values):
        self.config.update(values)

    def log(self, values, step=None, **kwargs):
        self.values[step] = values


class _DirRecorder(_Recorder):
    name = "dir_recorder"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str, **kwargs):
        super().__init__(run_name, **kwargs)
        self.logging_dir = logging_dir


@pytest.fixture
def registry():
    saved = dict(tracking.LOGGER_TYPE_TO_CLASS)
    yield tracking.LOGGER_TYPE_TO_CLASS
    tracking.LOGGER_TYPE_TO_CLASS.clear()
    tracking.LOGGER_TYPE_TO_CLASS.update(saved)


def test_a_registered_tracker_is_used_by_name(registry, tmp_path):
    tracking.register_tracker_class(_Recorder)
    assert registry["recorder"] is _Recorder and registry["tensorboard"] is tracking.TensorBoardTracker
    acc = Accelerator(log_with="recorder")
    acc.init_trackers("run", {"lr": 0.1}, init_kwargs={"recorder": {"colour": "blue"}})
    acc.log({"loss": 1.0}, step=3)
    t = acc.get_tracker("recorder")
    assert isinstance(t, _Recorder) and t.run_name == "run" and t.kwargs == {"colour": "blue"}
    assert t.config == {"lr": 0.1} and t.values == {3: {"loss": 1.0}}
    acc.end_training()
    tracking.register_tracker_class(_DirRecorder)
    with pytest.raises(ValueError, match="Logging with `dir_recorder` requires a `logging_dir`"):
        Accelerator(log_with="dir_recorder")
    acc = Accelerator(log_with="dir_recorder", project_dir=str(tmp_path))
    acc.init_trackers("run")
    assert acc.get_tracker("dir_recorder").logging_dir == str(tmp_path)


def test_register_tracker_class_refuses_and_warns(registry):
    class Nameless(GeneralTracker):
        requires_logging_directory = False

    class NoFlag(GeneralTracker):
        name = "no_flag"

    class Shadow(_Recorder):
        pass

    with pytest.raises(ValueError, match="must be a subclass of GeneralTracker, got <class 'dict'>"):
        tracking.register_tracker_class(dict)
    with pytest.raises(ValueError, match="Nameless.name must be a non-empty string"):
        tracking.register_tracker_class(Nameless)
    with pytest.raises(ValueError, match="NoFlag must define requires_logging_directory"):
        tracking.register_tracker_class(NoFlag)
    assert "no_flag" not in registry
    tracking.register_tracker_class(_Recorder)
    with pytest.warns(UserWarning, match="'recorder' \\(_Recorder\\) now means Shadow"):
        tracking.register_tracker_class(Shadow)
