"""The connector's options: checked types, environment overrides, the secret file, masking."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
from vllm.config import VllmConfig
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvbridge.adapters.vllm.connector import KVBridgeConnector
from kvbridge.adapters.vllm.options import Options
from kvbridge.adapters.vllm.plugin import register
from kvbridge.control.plane import Mode
from kvbridge.control.requests import TransferParams
from kvbridge.core.integrity import Verify

SECRET = "s3cr3t-Value"
ENV = ("KVBRIDGE_HOST", "KVBRIDGE_PORT", "KVBRIDGE_SECRET", "KVBRIDGE_SECRET_FILE")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests set the variables they need; none leaks in from the shell running them."""
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def _error(extra: dict[str, object], transport: str | None = None) -> str:
    with pytest.raises(ValueError) as err:
        Options.from_extra(extra, transport)
    message = str(err.value)
    assert "\n" not in message, message
    return message


# -- types and ranges -------------------------------------------------------------------------


def test_valid_options_are_converted_and_defaults_kept() -> None:
    assert Options.from_extra(None, None) == Options()
    options = Options.from_extra(
        {
            "transport": "cma",
            "transport_options": {"allow_peers": False},
            "mode": "push",
            "host": "10.0.0.1",
            "port": 65535,
            "timeout": 10,
            "lease": 0.5,
            "secret": SECRET,
            "kv_split": "opaque",
            "kv_layout": "blhnc",
            "verify": "sample",
        },
        None,
    )
    assert options.mode is Mode.PUSH and options.verify is Verify.SAMPLE
    assert isinstance(options.timeout, float) and options.timeout == 10.0
    assert (options.port, options.lease, options.kv_layout) == (65535, 0.5, "BLHNC")
    assert options.secret == SECRET and options.transport_options == {"allow_peers": False}
    assert Options.from_extra({"port": 1, "kv_split": None}, None).port == 1
    # prefill side channels take the form P publishes its own in
    peers = Options.from_extra({"prefill_peers": ["10.0.0.1:5790", "tcp://p2:5791"]}, None)
    assert peers.prefill_peers == ("tcp://10.0.0.1:5790", "tcp://p2:5791")


#: (option, bad value, what the message must say is expected)
BAD = [
    ("port", "5790", "an integer 1-65535"),
    ("port", 5790.0, "an integer 1-65535"),
    ("port", True, "an integer 1-65535"),
    ("port", 0, "an integer 1-65535"),
    ("port", 65536, "an integer 1-65535"),
    ("timeout", "ten", "a finite number of seconds > 0"),
    ("timeout", 0, "a finite number of seconds > 0"),
    ("timeout", -1.0, "a finite number of seconds > 0"),
    ("timeout", float("inf"), "a finite number of seconds > 0"),
    ("timeout", float("nan"), "a finite number of seconds > 0"),
    ("lease", "30", "a finite number of seconds > 0"),
    ("lease", 0.0, "a finite number of seconds > 0"),
    ("mode", "PULL", "'pull' or 'push'"),
    ("mode", "fetch", "'pull' or 'push'"),
    ("verify", "all", "'off', 'sample' or 'full'"),
    ("verify", True, "'off', 'sample' or 'full'"),
    ("kv_split", "head", "'head_kv' or 'opaque'"),
    ("kv_split", 1, "'head_kv' or 'opaque'"),
    ("kv_layout", "HND", "'auto' or one of vLLM's layouts"),
    ("kv_layout", 5, "'auto' or one of vLLM's layouts"),
    ("transport", "", "a non-empty string"),
    ("transport", ["nixl"], "a non-empty string"),
    ("transport_options", "protocol=tcp", "an object"),
    ("transport_options", {1: "x"}, "an object"),
    ("host", "", "a non-empty string"),
    ("host", 10, "a non-empty string"),
    ("secret_file", "", "a non-empty string (a file path)"),
    ("secret_file", 3, "a non-empty string (a file path)"),
    ("prefill_peers", "10.0.0.1:5790", "a list of prefill side channels, each 'host:port'"),
    ("prefill_peers", ["10.0.0.1"], "a list of prefill side channels, each 'host:port'"),
    ("prefill_peers", ["10.0.0.1:70000"], "a list of prefill side channels, each 'host:port'"),
    ("prefill_peers", ["http://p:8100"], "a list of prefill side channels, each 'host:port'"),
    ("claim_timeout", 0, "a finite number of seconds > 0"),
    ("claim_timeout", "5", "a finite number of seconds > 0"),
    ("max_held_requests", -1, "an integer >= 0"),
    ("max_held_requests", 1.5, "an integer >= 0"),
    ("max_held_fraction", 1.5, "a number in [0, 1]"),
    ("max_held_fraction", "half", "a number in [0, 1]"),
    ("insecure", "yes", "true or false"),
    ("insecure", 1, "true or false"),
    ("bootstrap_port", 0, "an integer 1-65535 (the port of P's bootstrap /query"),
    ("bootstrap_port", "8998", "an integer 1-65535"),
]


@pytest.mark.parametrize(("name", "value", "expected"), BAD)
def test_a_bad_option_is_one_line_naming_it_its_value_and_what_is_expected(
    name: str, value: object, expected: str
) -> None:
    message = _error({name: value})
    assert message.startswith(f"kvbridge option {name}={value!r}: expected "), message
    assert expected in message


def test_every_option_is_checked() -> None:
    checked = {name for name, _, _ in BAD} | {"secret"}  # the secret: see the masking tests
    assert checked == {f.name for f in dataclasses.fields(Options)} | {"secret_file"}


def test_the_message_from_the_issue() -> None:
    assert _error({"port": "5790"}) == "kvbridge option port='5790': expected an integer 1-65535"


def test_a_long_value_is_cut_to_keep_the_message_short() -> None:
    message = _error({"transport_options": ["x" * 500]})
    assert len(message) < 200 and "..." in message


def test_unknown_options_and_transport_conflicts_are_still_refused() -> None:
    assert "'secret_file'" in _error({"secert": SECRET})  # the known names include the new one
    assert SECRET not in _error({"secert": SECRET})
    assert "configured with transport 'mooncake'" in _error({"transport": "mooncake"}, "nixl")


def test_an_unknown_option_names_a_close_match_and_every_option() -> None:
    message = _error({"secert": SECRET, "prot": 5790})
    assert message.startswith(
        "kv_connector_extra_config has no kvbridge options 'secert' (did you mean 'secret'?), "
        "'prot' (did you mean 'port'?); its options are 'bootstrap_port', "
    )
    assert "'transport_options'" in message and "'verify'" in message


#: Each installed transport, a typo of one of its options, and the option meant.
TRANSPORT_TYPOS = {
    "mooncake": ("protcol", "protocol"),
    "nixl": ("backend", "backends"),
    "cma": ("timout", "timeout"),
}


@pytest.mark.parametrize("transport", sorted(TRANSPORT_TYPOS))
def test_a_mistyped_transport_option_fails_at_start_naming_the_transports_options(
    transport: str,
) -> None:
    """At the connector's start (before vLLM loads the model), not when a worker builds the
    transport: the transport's own check (``kvbridge.core.registry.check_options``)."""
    typo, meant = TRANSPORT_TYPOS[transport]
    message = _error({"transport": transport, "transport_options": {typo: "x"}})
    assert message.startswith(
        f"kvbridge option transport_options: transport {transport!r} has no option {typo!r} "
        f"(did you mean {meant!r}?); its options are "
    )
    assert "timeout" in message.split("its options are ")[1]
    # the per-transport connector (KVBridgeConnector-<name>) too
    assert message == _error({"transport_options": {typo: "x"}}, transport)


def test_a_transport_option_of_the_wrong_type_fails_at_start() -> None:
    message = _error({"transport": "mooncake", "transport_options": {"max_batch": "1024"}})
    assert message == (
        "kvbridge option transport_options: transport 'mooncake' option max_batch='1024' has "
        "type str; expected int"
    )


@pytest.mark.parametrize("transport", sorted(TRANSPORT_TYPOS))
def test_vllm_starting_the_connector_refuses_a_mistyped_transport_option(transport: str) -> None:
    register()
    typo, meant = TRANSPORT_TYPOS[transport]
    ktc = KVTransferConfig(
        kv_connector="KVBridgeConnector",
        kv_role="kv_both",
        engine_id="e",
        kv_connector_extra_config={"transport": transport, "transport_options": {typo: 1}},
    )
    with pytest.raises(ValueError, match=rf"\(did you mean '{meant}'\?\); its options are "):
        KVBridgeConnector.get_required_kvcache_layout(VllmConfig(kv_transfer_config=ktc))


@pytest.mark.parametrize(
    ("variable", "meant"),
    [
        ("KVBRIDGE_SECERT", "KVBRIDGE_SECRET"),
        ("KVBRIDGE_SECRETFILE", "KVBRIDGE_SECRET_FILE"),
        ("KVBRIDGE_PROT", "KVBRIDGE_PORT"),
        ("KVBRIDGE_HSOT", "KVBRIDGE_HOST"),
        ("KVBRIDGE_LOGLEVEL", "KVBRIDGE_LOG_LEVEL"),
    ],
)
def test_a_mistyped_environment_variable_stops_the_connector(
    monkeypatch: pytest.MonkeyPatch, variable: str, meant: str
) -> None:
    """A near miss of a variable the connector reads (KVBRIDGE_SECERT: no secret after all) is
    refused when vLLM starts the connector; other KVBRIDGE_ names (a harness's) are not."""
    monkeypatch.setenv(variable, SECRET)
    register()
    ktc = KVTransferConfig(kv_connector="KVBridgeConnector", kv_role="kv_both", engine_id="e")
    with pytest.raises(ValueError) as err:
        KVBridgeConnector.get_required_kvcache_layout(VllmConfig(kv_transfer_config=ktc))
    # vLLM 0.34 asks while it builds its config (kv_cache_access): pydantic's report holds it
    assert (
        f"kvbridge: environment variable {variable} is not one kvbridge reads (did you mean "
        f"{meant}?); rename or unset it (kvbridge reads KVBRIDGE_HOST, KVBRIDGE_LOG_LEVEL, "
        "KVBRIDGE_PORT, KVBRIDGE_SECRET, KVBRIDGE_SECRET_FILE)"
    ) in str(err.value)
    assert SECRET not in str(err.value)


def test_other_kvbridge_variables_are_left_alone() -> None:
    environ = {"KVBRIDGE_E2E": "1", "KVBRIDGE_TEST_FAULTS": "/tmp/x", "KVBRIDGE_TRANSPORT": "x"}
    assert Options.from_extra({}, None, environ=environ) == Options()


def test_a_conflicting_transport_timeout_fails_at_start() -> None:
    message = _error({"timeout": 5, "transport_options": {"timeout": 10}})
    assert message.startswith("kvbridge option transport_options.timeout=10: expected")
    assert "'ten'" in _error({"transport_options": {"timeout": "ten"}})
    options = Options.from_extra({"timeout": 5, "transport_options": {"timeout": 5.0}}, None)
    assert options.transport_timed()["timeout"] == 5.0


def test_the_connector_refuses_a_bad_option_when_vllm_starts_it() -> None:
    register()
    ktc = KVTransferConfig(
        kv_connector="KVBridgeConnector",
        kv_role="kv_both",
        engine_id="e",
        kv_connector_extra_config={"transport": "mooncake", "timeout": "ten"},
    )
    # vLLM 0.34 asks while it builds its config (kv_cache_access): pydantic's report holds it
    with pytest.raises(ValueError, match=r"(^|, )kvbridge option timeout='ten': expected "):
        KVBridgeConnector.get_required_kvcache_layout(VllmConfig(kv_transfer_config=ktc))


# -- environment --------------------------------------------------------------------------------


def test_the_environment_wins_over_the_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVBRIDGE_HOST", "10.0.0.7")
    monkeypatch.setenv("KVBRIDGE_PORT", "6000")
    monkeypatch.setenv("KVBRIDGE_SECRET", "from-env")
    options = Options.from_extra({"host": "10.0.0.1", "port": 5790, "secret": SECRET}, None)
    assert (options.host, options.port, options.secret) == ("10.0.0.7", 6000, "from-env")


def test_the_environment_supplies_what_the_json_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVBRIDGE_HOST", "fe80::1")
    monkeypatch.setenv("KVBRIDGE_PORT", " 6001\n")
    monkeypatch.setenv("KVBRIDGE_SECRET", "from-env")
    options = Options.from_extra({}, None)
    assert (options.host, options.port, options.secret) == ("fe80::1", 6001, "from-env")


def test_an_explicit_environment_mapping_replaces_the_process_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVBRIDGE_PORT", "6000")
    assert Options.from_extra({}, None, environ={}).port == 5790
    assert Options.from_extra({}, None, environ={"KVBRIDGE_PORT": "6002"}).port == 6002


@pytest.mark.parametrize("value", ["5790x", "0", "70000", "-1", "5790.0", "0x10"])
def test_a_bad_environment_port_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("KVBRIDGE_PORT", value)
    assert _error({"port": 5790}) == (
        f"kvbridge option port={value!r} (from KVBRIDGE_PORT): expected an integer 1-65535"
    )


@pytest.mark.parametrize("name", ENV)
def test_a_set_but_empty_variable_is_an_error(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setenv(name, " ")
    assert _error({"secret": SECRET}) == (
        f"kvbridge: {name} is set but empty; unset it or give a value"
    )


def test_env_overrides_are_logged_without_the_secret(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("KVBRIDGE_PORT", "6000")
    monkeypatch.setenv("KVBRIDGE_SECRET", "env-" + SECRET)
    with caplog.at_level(logging.INFO, logger="kvbridge.vllm"):
        Options.from_extra({"port": 5790, "secret": SECRET}, None)
    text = caplog.text
    assert "port=6000 from KVBRIDGE_PORT" in text and "secret from KVBRIDGE_SECRET" in text
    assert SECRET not in text


# -- the secret file ------------------------------------------------------------------------------


def test_the_secret_is_read_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text(f" {SECRET} x\n")
    assert Options.from_extra({"secret_file": str(path)}, None).secret == f" {SECRET} x"
    path.write_bytes(f"{SECRET}\r\n".encode())
    assert Options.from_extra({"secret_file": str(path)}, None).secret == SECRET


def test_the_secret_file_of_the_environment_wins(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "secret"
    path.write_text("from-file\n")
    monkeypatch.setenv("KVBRIDGE_SECRET_FILE", str(path))
    assert Options.from_extra({"secret": SECRET}, None).secret == "from-file"
    # The environment replaces the JSON's choice: its secret_file is not even read.
    assert Options.from_extra({"secret_file": "/nonexistent"}, None).secret == "from-file"
    monkeypatch.delenv("KVBRIDGE_SECRET_FILE")
    monkeypatch.setenv("KVBRIDGE_SECRET", "from-env")
    assert Options.from_extra({"secret_file": str(path)}, None).secret == "from-env"


def test_two_sources_of_one_layer_are_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "secret"
    path.write_text(SECRET)
    message = _error({"secret": SECRET, "secret_file": str(path)})
    assert message == "kvbridge options secret and secret_file are both given: give one"
    monkeypatch.setenv("KVBRIDGE_SECRET", SECRET)
    monkeypatch.setenv("KVBRIDGE_SECRET_FILE", str(path))
    assert _error({}) == "kvbridge: KVBRIDGE_SECRET and KVBRIDGE_SECRET_FILE are both set: set one"


def test_an_unreadable_secret_file_is_one_error_naming_the_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    missing = tmp_path / "missing"
    assert _error({"secret_file": str(missing)}) == (
        f"kvbridge option secret_file={str(missing)!r}: cannot read it (No such file or directory)"
    )
    assert _error({"secret_file": str(tmp_path)}).startswith(
        f"kvbridge option secret_file={str(tmp_path)!r}: cannot read it ("
    )
    empty = tmp_path / "empty"
    empty.write_text("\n")
    assert _error({"secret_file": str(empty)}).endswith(f"{str(empty)!r}: the file is empty")
    monkeypatch.setenv("KVBRIDGE_SECRET_FILE", str(missing))
    assert _error({}).startswith(f"kvbridge KVBRIDGE_SECRET_FILE={str(missing)!r}: cannot read")


def test_a_secret_file_that_is_not_text_shows_none_of_it(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_bytes(SECRET.encode() + b"\xff\xfe")
    with pytest.raises(ValueError) as err:
        Options.from_extra({"secret_file": str(path)}, None)
    assert str(err.value).endswith("the file is not UTF-8 text")
    # No chained UnicodeDecodeError (it would carry the file's bytes into the traceback).
    assert err.value.__context__ is None and err.value.__cause__ is None


# -- masking --------------------------------------------------------------------------------------


def test_the_secret_is_masked_in_repr_and_str() -> None:
    options = Options.from_extra({"secret": SECRET, "port": 5791}, None)
    for text in (repr(options), str(options), f"{options}", repr([options])):
        assert SECRET not in text and "secret=***" in text and "port=5791" in text
    assert "secret=None" in repr(Options())
    assert options.secret == SECRET  # masked when shown, not when used


@pytest.mark.parametrize("value", ["", 12345, ["s3cr3t-Value"], {"v": SECRET}])
def test_a_bad_secret_is_reported_without_its_value(value: object) -> None:
    message = _error({"secret": value})
    assert message.startswith(f"kvbridge option secret=<hidden {type(value).__name__}>: ")
    assert "expected a non-empty string" in message
    assert SECRET not in message and "12345" not in message


def test_a_bad_environment_secret_is_reported_without_its_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVBRIDGE_SECRET", SECRET)
    monkeypatch.setenv("KVBRIDGE_PORT", "x")
    assert SECRET not in _error({})  # another option's error
    monkeypatch.delenv("KVBRIDGE_PORT")
    assert SECRET not in repr(Options.from_extra({}, None))


def test_the_connector_takes_tensor_and_pipeline_parallelism() -> None:
    # Each worker (a TP rank of a pipeline stage) is a peer of its own, at port + its index
    # (stage-major); P's published parameters name every worker and the stage count.
    register()
    ktc = KVTransferConfig(
        kv_connector="KVBridgeConnector",
        kv_role="kv_consumer",
        engine_id="e",
        kv_connector_extra_config={"transport": "mooncake", "port": 6100},
    )
    config = VllmConfig(kv_transfer_config=ktc)
    config.parallel_config.tensor_parallel_size = 2
    assert KVBridgeConnector.get_required_kvcache_layout(config) == "LBHNC"
    connector = KVBridgeConnector(config, KVConnectorRole.SCHEDULER, _no_groups())
    assert connector.scheduler is not None
    assert [(r.engine_id, r.endpoint) for r in connector.scheduler.ranks] == [
        ("e.tp0", "tcp://127.0.0.1:6100"),
        ("e.tp1", "tcp://127.0.0.1:6101"),
    ]
    assert connector.scheduler.holds is not None  # half of the pool by default
    assert connector.scheduler.holds.limits.max_blocks == 50
    # TP rank 1 would bind port + 1 = 65536: refused at start, naming the sum
    high = KVTransferConfig(
        kv_connector="KVBridgeConnector",
        kv_role="kv_consumer",
        engine_id="e",
        kv_connector_extra_config={"transport": "mooncake", "port": 65535},
    )
    high_config = VllmConfig(kv_transfer_config=high)
    high_config.parallel_config.tensor_parallel_size = 2
    with pytest.raises(ValueError, match=r"port \+ rank \(65535 \+ 1\) = 65536"):
        KVBridgeConnector(high_config, KVConnectorRole.SCHEDULER, _no_groups())
    config.parallel_config.pipeline_parallel_size = 2
    assert KVBridgeConnector.get_required_kvcache_layout(config) == "LBHNC"
    staged = KVBridgeConnector(config, KVConnectorRole.SCHEDULER, _no_groups())
    assert staged.scheduler is not None
    assert [(r.engine_id, r.endpoint) for r in staged.scheduler.ranks] == [
        ("e.pp0.tp0", "tcp://127.0.0.1:6100"),
        ("e.pp0.tp1", "tcp://127.0.0.1:6101"),
        ("e.pp1.tp0", "tcp://127.0.0.1:6102"),
        ("e.pp1.tp1", "tcp://127.0.0.1:6103"),
    ]
    address = staged.scheduler.prefill_address()
    assert address["pp_size"] == 2 and len(address["ranks"]) == 4
    params = TransferParams.layerwise_of(address, "r", "t", Mode.PULL)
    assert (params.tp_size, params.pp_size) == (2, 2)
    # the last worker binds port + 3
    high_config.parallel_config.tensor_parallel_size = 1
    high_config.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(ValueError, match=r"port \+ rank \(65535 \+ 1\) = 65536"):
        KVBridgeConnector(high_config, KVConnectorRole.SCHEDULER, _no_groups())


def test_sleep_mode_is_refused_at_start_in_one_line() -> None:
    """Sleeping remaps the KV cache under the transport's registration: vLLM 0.33 asks the
    connector (``supports_sleep_mode``) and refuses with its own line; on any version the
    connector refuses too, before a worker registers anything."""
    from types import SimpleNamespace

    from kvbridge.adapters.vllm.options import SLEEP_MODE_REFUSED

    register()
    ktc = KVTransferConfig(
        kv_connector="KVBridgeConnector",
        kv_role="kv_consumer",
        engine_id="e",
        kv_connector_extra_config={"transport": "mooncake", "port": 6100},
    )
    assert KVBridgeConnector.supports_sleep_mode(ktc) is False
    config = VllmConfig(kv_transfer_config=ktc)
    config.model_config = SimpleNamespace(enable_sleep_mode=True, use_mla=False)  # type: ignore[assignment]
    for start in (
        lambda: KVBridgeConnector.get_required_kvcache_layout(config),
        lambda: KVBridgeConnector(config, KVConnectorRole.WORKER, _no_groups()),
    ):
        with pytest.raises(ValueError) as err:
            start()
        assert str(err.value) == SLEEP_MODE_REFUSED and "\n" not in str(err.value)
    import vllm

    if tuple(int(p) for p in vllm.__version__.split(".")[:2]) >= (0, 33):
        # vLLM's own check, through its connector factory (0.32 has none)
        with pytest.raises(ValueError, match="KVBridgeConnector does not support sleep mode"):
            config._verify_kv_transfer_compat()


def _no_groups():  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    return SimpleNamespace(kv_cache_groups=[], num_blocks=100)


# -- weak settings (issue 28) ------------------------------------------------------------------


def test_a_side_channel_other_hosts_reach_needs_a_secret_or_insecure() -> None:
    message = _error({"host": "10.0.0.1"})
    assert "reachable from other hosts but has no secret" in message
    assert "insecure: true" in message
    assert _error({"host": "0.0.0.0"}).startswith("kvbridge option: the side channel on 0.0.0.0")
    assert Options.from_extra({"host": "10.0.0.1", "secret": SECRET}, None).secret == SECRET
    assert Options.from_extra({"host": "10.0.0.1", "insecure": True}, None).insecure
    for loopback in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert Options.from_extra({"host": loopback}, None).secret is None


def test_port_plus_rank_must_fit_for_every_tp_rank() -> None:
    options = Options.from_extra({"port": 65535}, None)
    options.refuse_weak(1)
    with pytest.raises(ValueError) as err:
        options.refuse_weak(2)
    assert "port + rank (65535 + 1) = 65536 is outside 1-65535" in str(err.value)
    Options.from_extra({"port": 65534}, None).refuse_weak(2)


def test_an_empty_secret_is_refused_wherever_it_comes_from(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert "secret" in _error({"secret": ""})
    empty = tmp_path / "empty"
    empty.write_text("\n")
    assert "empty" in _error({"secret_file": str(empty)})
    monkeypatch.setenv("KVBRIDGE_SECRET", "")
    assert "KVBRIDGE_SECRET is set but empty" in _error({})
