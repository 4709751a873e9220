"""Engine configuration layers (flag > env > file > default), conf/engine.toml, errors naming the key."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tokenwire.engine.config import EngineConfig, build_engine_config, engine_keys, torch_threads
from tokenwire.engine.server import load_engine_config
from tokenwire.middleware import ConfigError
from tokenwire.middleware.core.config import SlowClientPolicy, load_toml

CONF = Path(__file__).resolve().parents[2] / "conf" / "engine.toml"


def test_conf_file_has_every_key_with_its_default() -> None:
    values = load_toml(CONF)
    assert set(values) == {key.name for key in engine_keys()}
    assert build_engine_config(file_values=values) == EngineConfig()


def test_precedence_flag_over_env_over_file_over_default(tmp_path: Path) -> None:
    config_file = tmp_path / "engine.toml"
    config_file.write_text('max_running = 3\nmax_waiting = 7\nkv_budget_tokens = 1000\n'
                           'listen = "unix:/tmp/from-file.sock"\n')
    environ = {"TOKENWIRE_ENGINE_MAX_RUNNING": "4", "TOKENWIRE_ENGINE_MAX_WAITING": "8",
               # The sidecar's variables (bare prefix) are not the engine's.
               "TOKENWIRE_LISTEN": "0.0.0.0:8080", "TOKENWIRE_HEARTBEAT_S": "1"}
    config = load_engine_config(["--config", str(config_file), "--max-running", "5"], environ)
    assert config.max_running == 5                      # flag
    assert config.max_waiting == 8                      # env
    assert config.kv_budget_tokens == 1000              # file
    assert config.listen == "unix:/tmp/from-file.sock"  # file, not the sidecar's TOKENWIRE_LISTEN
    assert config.max_prefill_tokens_per_step == 96    # default


def test_wire_keys_take_the_engine_prefix_and_the_same_precedence(tmp_path: Path) -> None:
    config_file = tmp_path / "engine.toml"
    config_file.write_text('heartbeat_s = 3\nwrite_deadline_s = 9.5\nmax_pending_bytes = 4096\n'
                           'slow_client_policy = "drop"\nresume = true\n')
    environ = {"TOKENWIRE_ENGINE_HEARTBEAT_S": "2", "TOKENWIRE_ENGINE_COMMIT_DEADLINE_S": "0.5",
               "TOKENWIRE_ENGINE_RESUME": "false",
               # The sidecar's spelling of the same key is not the engine's.
               "TOKENWIRE_WRITE_DEADLINE_S": "99"}
    config = load_engine_config(["--config", str(config_file), "--heartbeat-s", "1.5",
                                 "--terminal-marker", ""], environ)
    wire = config.wire
    assert wire.heartbeat_s == 1.5                       # flag
    assert wire.commit_deadline_s == 0.5                 # env
    assert wire.resume is False                          # env over file
    assert wire.write_deadline_s == 9.5                  # file, not TOKENWIRE_WRITE_DEADLINE_S
    assert wire.max_pending_bytes == 4096                # file
    assert wire.slow_client_policy is SlowClientPolicy.DROP
    assert wire.terminal_marker is None                  # empty flag = no marker
    assert wire.retry_attempts == 0                      # the engine's own default


def test_the_engine_sets_its_wire_defaults_explicitly() -> None:
    """The middleware's defaults may change; the engine's streams end with their
    dialect's terminal event ([DONE] on its OpenAI routes) and cannot be retried once
    handed over, whatever they are."""
    wire = EngineConfig().wire
    assert (wire.retry_attempts, wire.terminal_marker) == (0, "auto")
    assert build_engine_config(flags={"retry_attempts": "1"}).wire.retry_attempts == 1


def test_threads_default_to_the_usable_cpus_minus_one_for_the_loop() -> None:
    usable = len(os.sched_getaffinity(0))
    assert torch_threads(EngineConfig()) == max(1, usable - 1)
    assert torch_threads(build_engine_config(flags={"threads": "3"})) == 3
    assert build_engine_config(file_values={"threads": 0}).threads is None


def test_scheduler_process_is_a_flag_a_variable_and_a_key(tmp_path: Path) -> None:
    assert build_engine_config().scheduler_process is True
    assert build_engine_config(flags={"scheduler_process": "false"}).scheduler_process is False
    assert build_engine_config(
        environ={"TOKENWIRE_ENGINE_SCHEDULER_PROCESS": "0"}).scheduler_process is False
    assert build_engine_config(file_values={"scheduler_process": False}).scheduler_process is False
    assert build_engine_config(flags={"scheduler_process": "true"},
                               file_values={"scheduler_process": False}).scheduler_process is True


def test_config_file_from_the_environment(tmp_path: Path) -> None:
    config_file = tmp_path / "engine.toml"
    config_file.write_text('model = "/models/qwen"\nserved_model_name = "qwen"\n')
    config = load_engine_config([], {"TOKENWIRE_ENGINE_CONFIG": str(config_file)})
    assert (config.model, config.served_model_name) == ("/models/qwen", "qwen")


def test_optional_keys_unset_by_empty_or_zero() -> None:
    config = build_engine_config(flags={"max_model_len": "4096", "served_model_name": "m"})
    assert (config.max_model_len, config.served_model_name) == (4096, "m")
    config = build_engine_config(file_values={"max_model_len": 0, "served_model_name": ""})
    assert (config.max_model_len, config.served_model_name) == (None, None)
    assert build_engine_config(environ={"TOKENWIRE_ENGINE_MAX_MODEL_LEN": ""}).max_model_len is None


@pytest.mark.parametrize(("flags", "environ", "file_values", "key"), [
    ({"max_running": "many"}, {}, {}, "max_running"),
    ({}, {"TOKENWIRE_ENGINE_KV_BUDGET_TOKENS": "1.5"}, {}, "kv_budget_tokens"),
    ({}, {}, {"max_waiting": "10"}, "max_waiting"),
    ({}, {}, {"max_runing": 1}, "max_runing"),
    ({"max_prefill_tokens_per_step": "-1"}, {}, {}, "max_prefill_tokens_per_step"),
    ({"max_model_len": "1"}, {}, {}, "max_model_len"),
    ({}, {}, {"max_running": True}, "max_running"),
    ({"listen": "nowhere"}, {}, {}, "listen"),
    ({}, {}, {"log_level": "loud"}, "log_level"),
    ({}, {}, {"model": 7}, "model"),
    ({"heartbeat_s": "soon"}, {}, {}, "heartbeat_s"),
    ({"threads": "-2"}, {}, {}, "threads"),
    ({"scheduler_process": "sometimes"}, {}, {}, "scheduler_process"),
    ({}, {}, {"scheduler_process": "yes"}, "scheduler_process"),
    ({}, {"TOKENWIRE_ENGINE_RESUME": "maybe"}, {}, "resume"),
    ({}, {}, {"slow_client_policy": "shout"}, "slow_client_policy"),
    ({}, {}, {"write_deadline_s": 0}, "write_deadline_s"),
    ({}, {}, {"heartbeat_s": "15"}, "heartbeat_s"),
])
def test_bad_values_and_unknown_keys_name_the_key(flags: dict[str, str], environ: dict[str, str],
                                                  file_values: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as error:
        build_engine_config(flags=flags, environ=environ, file_values=file_values)
    assert error.value.key == key


def test_unreadable_config_file_names_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as error:
        load_engine_config(["--config", str(tmp_path / "missing.toml")], {})
    assert error.value.key == "config"
    broken = tmp_path / "broken.toml"
    broken.write_text("max_running = = 3\n")
    with pytest.raises(ConfigError) as error:
        load_engine_config(["--config", str(broken)], {})
    assert error.value.key == "config"


@pytest.mark.slow
def test_cli_reports_a_bad_file_before_loading_a_model(tmp_path: Path) -> None:
    """The real command line, in its own process: exit 2 and the key, no model built."""
    config_file = tmp_path / "engine.toml"
    config_file.write_text("max_running = 0\n")
    result = subprocess.run([sys.executable, "-m", "tokenwire.engine.server", "--config", str(config_file)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "max_running" in result.stderr


def test_event_loop_is_a_key_and_auto_follows_where_the_scheduler_runs() -> None:
    from tokenwire.engine.config import event_loop, runs_scheduler_process, usable_cpus

    assert build_engine_config().event_loop == "auto"
    in_process = usable_cpus() >= 2
    assert runs_scheduler_process(build_engine_config()) is in_process
    assert event_loop(build_engine_config()) == ("uvloop" if in_process else "asyncio")
    assert event_loop(build_engine_config(flags={"scheduler_process": "false"})) == "asyncio"
    assert event_loop(build_engine_config(environ={"TOKENWIRE_ENGINE_EVENT_LOOP": "uvloop",
                                                   "TOKENWIRE_ENGINE_SCHEDULER_PROCESS": "0"})) == "uvloop"
    assert event_loop(build_engine_config(file_values={"event_loop": "asyncio",
                                                       "scheduler_process": True})) == "asyncio"
    with pytest.raises(ConfigError, match="event_loop"):
        build_engine_config(flags={"event_loop": "trio"})


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity (Linux)")
def test_the_scheduler_process_needs_two_usable_cpus() -> None:
    """A real process pinned to one CPU runs the scheduler in a thread (and asyncio's loop),
    ``scheduler_process = true`` or not; given two it runs it in a process of its own."""
    program = ("import os, sys\n"
               "os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(',')})\n"
               "from tokenwire.engine.config import EngineConfig, event_loop, runs_scheduler_process\n"
               "print(runs_scheduler_process(EngineConfig()), event_loop(EngineConfig()))\n")
    cpus = sorted(os.sched_getaffinity(0))

    def placement(pinned: list[int]) -> str:
        result = subprocess.run([sys.executable, "-c", program, ",".join(map(str, pinned))],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        return result.stdout.strip()

    assert placement(cpus[:1]) == "False asyncio"
    if len(cpus) >= 2:
        assert placement(cpus[:2]) == "True uvloop"


@pytest.mark.slow
@pytest.mark.parametrize("where", ["busy port", "missing socket directory"])
def test_cli_that_cannot_listen_says_where_in_one_line_and_exits_before_loading_a_model(
        tmp_path: Path, where: str) -> None:
    """Listening comes first: a busy port or a missing socket directory is exit 2
    and one line naming the address or the folder, with no model loaded (a
    traceback and a process left running were what a supervisor saw)."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        listen, named = ((f"127.0.0.1:{port}", f"127.0.0.1:{port}") if where == "busy port"
                         else (f"unix:{tmp_path}/absent/engine.sock", f"{tmp_path}/absent"))
        # A model path that does not exist: were the model loaded first, this
        # would fail on the model instead, naming it.
        result = subprocess.run([sys.executable, "-m", "tokenwire.engine.server", "--listen", listen,
                                 "--model", str(tmp_path / "no-model")],
                                capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot listen" in lines[0] and named in lines[0], result.stderr
    assert "Traceback" not in result.stderr and "no-model" not in result.stderr
