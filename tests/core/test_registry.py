"""Transport discovery through entry points (throw-away third-party distributions on sys.path) and
the in-process registration seam."""

from __future__ import annotations

import contextlib
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import kvbridge
import kvbridge.core.registry
from kvbridge.core import (
    TransferOp,
    Transport,
    TransportConflictError,
    TransportLimits,
    TransportNotFoundError,
    TransportOptionError,
    TransportUnavailableError,
    register_transport,
    unregister_transport,
)
from kvbridge.core.registry import check_options, load_transport_class

PLUGIN = textwrap.dedent(
    '''
    """A third-party transport: copies within one process with ctypes.memmove."""
    import ctypes

    from kvbridge.core.batches import TransferOp
    from kvbridge.core.contract import TransportLimits
    from kvbridge.core.transport import Transport


    class MemmoveTransport(Transport):
        """Every engine hook; the base does the rest (peers, checks, handles, deadlines)."""

        name = "memmove"
        install_hint = "pip install 'thirdparty-transport[fancy]'"

        def __init__(self, *, timeout=5.0, label="x"):
            super().__init__(timeout=timeout)
            self.label = label
            self.open(TransportLimits())

        def engine_register(self, device, ranges):
            pass

        def engine_deregister(self, device, ranges):
            pass

        def engine_metadata(self):
            return self.label.encode()

        def engine_connect(self, peer, payload, old):
            return payload.decode()

        def engine_start_chunk(self, state, chunk):
            pairs = zip(chunk.local.tolist(), chunk.remote.tolist(), chunk.lengths.tolist())
            for l, r, n in pairs:
                src, dst = (r, l) if chunk.op is TransferOp.READ else (l, r)
                ctypes.memmove(dst, src, n)
            return None  # finished inside the call

        def engine_check_chunk(self, chunk):
            return None  # never asked: every chunk finished inside engine_start_chunk

        def engine_check_remote(self, state, remote, lengths, peer):
            pass  # its peers are transports of this process: nothing to check against


    class NeedsEngineTransport(MemmoveTransport):
        name = "needs-engine"

        @classmethod
        def engine_import(cls):
            import fancy_engine  # not installed

            return fancy_engine
    '''
)

ENTRY_POINTS = textwrap.dedent(
    """
    [kvbridge.transports]
    memmove = thirdparty_transport:MemmoveTransport
    needs-engine = thirdparty_transport:NeedsEngineTransport
    unimportable = thirdparty_missing_module:Transport
    """
)


@pytest.fixture
def third_party(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A distribution that exists only in a temporary directory on sys.path."""
    (tmp_path / "thirdparty_transport.py").write_text(PLUGIN)
    info = tmp_path / "thirdparty_transport-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: thirdparty-transport\nVersion: 0.1\n"
    )
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("thirdparty_transport", None)


def test_third_party_transport_is_discovered_and_moves_bytes(third_party):
    infos = {info.name: info for info in kvbridge.available_transports()}
    assert infos["memmove"].usable
    assert infos["memmove"].package == "thirdparty-transport 0.1"

    transport = kvbridge.load_transport("memmove", label="peer-a", timeout=2.0)
    assert isinstance(transport, Transport)
    assert transport.timeout == 2.0
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    from kvbridge.core import MemoryRange

    transport.register([MemoryRange(dst.ctypes.data, dst.nbytes)])
    other = kvbridge.load_transport("memmove", label="peer-b")
    transport.connect("peer", other.metadata())
    other.close()
    local = np.array([dst.ctypes.data + 8], dtype=np.uint64)
    remote = np.array([src.ctypes.data + 16], dtype=np.uint64)
    transport.transfer(TransferOp.READ, "peer", local, remote, np.array([32], dtype=np.uint64))
    assert dst[8:40].tolist() == list(range(16, 48))
    assert dst[:8].tolist() == [0] * 8
    transport.close()


def test_missing_engine_names_the_package_to_install(third_party):
    infos = {info.name: info for info in kvbridge.available_transports()}
    assert not infos["needs-engine"].usable
    assert "pip install 'thirdparty-transport[fancy]'" in infos["needs-engine"].reason
    with pytest.raises(TransportUnavailableError, match="fancy_engine"):
        kvbridge.load_transport("needs-engine")


def test_unimportable_plugin_is_reported_not_fatal(third_party):
    infos = {info.name: info for info in kvbridge.available_transports()}
    assert not infos["unimportable"].usable
    assert "thirdparty_missing_module" in infos["unimportable"].reason
    with pytest.raises(TransportUnavailableError, match="cannot be imported"):
        kvbridge.load_transport("unimportable")


def test_unknown_name_lists_the_installed_transports(third_party):
    with pytest.raises(TransportNotFoundError) as err:
        kvbridge.load_transport("carrier-pigeon")
    message = str(err.value)
    assert "'carrier-pigeon'" in message
    assert "memmove" in message and "needs-engine" in message


def test_without_the_distribution_the_name_is_unknown():
    with pytest.raises(TransportNotFoundError):
        kvbridge.load_transport("memmove")


# -- importlib.metadata discovery: only the named plugin, one owner per name ---------------------

BROKEN = 'raise RuntimeError("thirdparty_broken was imported")\n'


def _distribution(root: Path, name: str, version: str, entry_points: str) -> Path:
    """A ``.dist-info`` for distribution ``name`` under ``root`` (not yet on sys.path)."""
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(entry_points)
    return root


@pytest.fixture
def broken_neighbour(third_party: Path) -> Path:
    """A second entry point of the third-party distribution whose module raises on import."""
    (third_party / "thirdparty_broken.py").write_text(BROKEN)
    eps = third_party / "thirdparty_transport-0.1.dist-info" / "entry_points.txt"
    eps.write_text(ENTRY_POINTS + "broken = thirdparty_broken:Transport\n")
    yield third_party
    sys.modules.pop("thirdparty_broken", None)


def test_loading_one_transport_imports_no_other_plugin(broken_neighbour):
    transport = kvbridge.load_transport("memmove")
    transport.close()
    assert "thirdparty_transport" in sys.modules
    assert "thirdparty_broken" not in sys.modules
    assert "thirdparty_missing_module" not in sys.modules
    # The listing imports every plugin, and reports the broken one without hiding the others.
    infos = {info.name: info for info in kvbridge.available_transports()}
    assert not infos["broken"].usable
    assert "thirdparty_broken was imported" in infos["broken"].reason
    assert infos["memmove"].usable


def test_a_plugin_that_fails_to_import_says_so(broken_neighbour):
    with pytest.raises(TransportUnavailableError) as err:
        kvbridge.load_transport("broken")
    message = str(err.value)
    assert "'broken'" in message and "thirdparty-transport 0.1" in message
    assert "RuntimeError: thirdparty_broken was imported" in message
    assert "\n" not in message


def test_two_distributions_declaring_one_name_are_refused_naming_both(
    third_party, tmp_path_factory, monkeypatch
):
    other = _distribution(
        tmp_path_factory.mktemp("other"),
        "other-transport",
        "2.0",
        "[kvbridge.transports]\nmemmove = other_transport:Memmove\n",
    )
    monkeypatch.syspath_prepend(str(other))
    with pytest.raises(TransportConflictError) as err:
        kvbridge.load_transport("memmove")
    message = str(err.value)
    assert "'memmove'" in message
    assert "thirdparty-transport 0.1" in message and "other-transport 2.0" in message
    assert "\n" not in message
    assert "other_transport" not in sys.modules  # refused before importing either
    infos = {info.name: info for info in kvbridge.available_transports()}
    assert not infos["memmove"].usable
    assert "other-transport 2.0" in infos["memmove"].reason
    # The other names of the distribution are not affected.
    assert infos["needs-engine"].package == "thirdparty-transport 0.1"


def test_one_distribution_twice_on_sys_path_counts_once(third_party, tmp_path_factory, monkeypatch):
    # An editable install and its source tree, say: two copies of one distribution's metadata,
    # here also spelled differently (names compare normalized, as pip compares them).
    copy = _distribution(
        tmp_path_factory.mktemp("copy"), "thirdparty_transport", "0.1", ENTRY_POINTS
    )
    monkeypatch.syspath_prepend(str(copy))
    assert kvbridge.core.registry.transport_names().count("memmove") == 1
    infos = [info for info in kvbridge.available_transports() if info.name == "memmove"]
    assert len(infos) == 1 and infos[0].usable
    assert infos[0].package == "thirdparty_transport 0.1"  # the first on sys.path
    kvbridge.load_transport("memmove").close()


def test_names_are_listed_without_importing_plugins(broken_neighbour):
    from kvbridge.core.registry import transport_names

    names = transport_names()
    assert {"memmove", "needs-engine", "unimportable", "broken", "cma"} <= set(names)
    assert names == sorted(names)
    assert "thirdparty_transport" not in sys.modules


def test_a_transport_installed_since_the_last_lookup_is_seen(third_party):
    from kvbridge.core.registry import transport_names

    assert "late" not in transport_names()
    kvbridge.load_transport("memmove").close()  # a lookup that loads, before the install
    _distribution(third_party, "late-transport", "1.0", "[kvbridge.transports]\nlate = x:Y\n")
    assert "late" in transport_names()
    with pytest.raises(TransportUnavailableError, match=r"'late'.*late-transport 1\.0"):
        kvbridge.load_transport("late")  # found, and its (missing) module tried


# What stevedore's own entry-point cache would lose: run in a process of its own, with the cache
# directory in a temporary one, so that neither stevedore's in-process memo nor its files touch
# other tests (or the user's ~/.cache).
STEVEDORE_CACHE = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path

    root = Path(sys.argv[1])
    sys.path.insert(0, str(root))
    from stevedore import ExtensionManager

    from kvbridge.core.registry import NAMESPACE, transport_names

    def install(name):
        info = root / f"{name}_transport-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\\nName: {name}-transport\\nVersion: 1.0\\n")
        (info / "entry_points.txt").write_text(f"[{NAMESPACE}]\\n{name} = {name}_mod:T\\n")

    def stevedore_lists():
        manager = ExtensionManager.make_test_instance([], namespace=NAMESPACE)
        return manager.list_entry_points()  # its cache's answer; imports nothing

    install("first")
    before = stevedore_lists()
    install("second")
    ExtensionManager.ENTRY_POINT_CACHE.clear()  # the part of its cache it makes public
    after = stevedore_lists()
    print(json.dumps({
        "before": sorted(ep.name for ep in before),
        "after": sorted(ep.name for ep in after),
        "dists": sorted({repr(ep.dist) for ep in after}),
        "kvbridge": transport_names(),
    }))
    """
)


def test_stevedore_cache_would_hide_a_new_transport_and_its_distribution(tmp_path):
    """Why the registry reads the metadata itself and hands stevedore's manager the entry points
    (``list_entry_points``): stevedore's cache keeps what it read first for the process's life,
    even with its public per-namespace cache emptied, and its entry points no longer say which
    distribution declares them, which a conflict must name."""
    import json
    import os
    import subprocess

    root = tmp_path / "site"
    root.mkdir()
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-c", STEVEDORE_CACHE, str(root)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert "first" in seen["before"]
    assert "second" not in seen["after"]  # stevedore's cache: the new transport stays unseen
    assert seen["dists"] == ["None"]  # and no entry point says its distribution
    assert {"first", "second"} <= set(seen["kvbridge"])  # kvbridge's lookup sees both


# -- register_transport / unregister_transport ---------------------------------------------------


class _Local(Transport):
    """A registered transport: every engine hook, nothing moves (not the point here)."""

    name = "local"

    def __init__(self, *, timeout: float = 5.0, label: str = "") -> None:
        super().__init__(timeout=timeout)
        self.label = label
        self.open(TransportLimits())

    def engine_register(self, device, ranges):
        pass

    def engine_deregister(self, device, ranges):
        pass

    def engine_metadata(self):
        return b""

    def engine_connect(self, peer, payload, old):
        return payload

    def engine_start_chunk(self, state, chunk):
        return None

    def engine_check_chunk(self, chunk):
        return None  # never asked: nothing is started

    def engine_check_remote(self, state, remote, lengths, peer):
        pass


class _Unavailable(_Local):
    install_hint = "pip install nothing-real"

    @classmethod
    def engine_import(cls):
        raise ImportError("no engine here")


@pytest.fixture
def registered() -> Iterator[list[str]]:
    """Names a test registers; each is unregistered after the test."""
    names: list[str] = []
    yield names
    for name in names:
        with contextlib.suppress(TransportNotFoundError):
            unregister_transport(name)


def test_registered_transport_is_loaded_by_name_and_listed(registered):
    register_transport("local", _Local)
    registered.append("local")
    assert load_transport_class("local") is _Local
    transport = kvbridge.load_transport("local", label="x", timeout=1.0)
    assert isinstance(transport, _Local) and transport.label == "x" and transport.timeout == 1.0
    transport.close()
    infos = {info.name: info for info in kvbridge.available_transports()}
    assert infos["local"].usable
    assert "registered in this process" in infos["local"].package
    assert "_Local" in infos["local"].package
    with pytest.raises(TransportNotFoundError) as err:
        kvbridge.load_transport("carrier-pigeon")
    assert "local (registered)" in str(err.value) and "cma" in str(err.value)


def test_registering_a_taken_name_needs_replace(registered):
    register_transport("local", _Local)
    registered.append("local")
    with pytest.raises(
        TransportConflictError, match=r"'local' is registered already .*replace=True"
    ):
        register_transport("local", _Unavailable)
    assert load_transport_class("local") is _Local
    register_transport("local", _Unavailable, replace=True)
    with pytest.raises(TransportUnavailableError, match="no engine here"):
        load_transport_class("local")  # a registered class is checked like an installed one
    infos = {info.name: info for info in kvbridge.available_transports()}
    assert not infos["local"].usable and "nothing-real" in infos["local"].reason


def test_an_installed_name_is_shadowed_only_with_replace(registered):
    from kvbridge.transports.cma import CmaTransport

    with pytest.raises(
        TransportConflictError, match=r"'cma' is installed \(kvbridge .*replace=True"
    ):
        register_transport("cma", _Local)
    assert load_transport_class("cma") is CmaTransport
    register_transport("cma", _Local, replace=True)
    registered.append("cma")
    assert load_transport_class("cma") is _Local
    unregister_transport("cma")
    assert load_transport_class("cma") is CmaTransport  # the installed one is back


def test_unregister_takes_back_only_registered_names(registered):
    register_transport("local", _Local)
    unregister_transport("local")
    with pytest.raises(TransportNotFoundError):
        kvbridge.load_transport("local")
    with pytest.raises(TransportNotFoundError, match="'local'"):
        unregister_transport("local")
    with pytest.raises(TransportNotFoundError, match="only what register_transport registered"):
        unregister_transport("cma")  # installed, never registered
    assert load_transport_class("cma").name == "cma"


@pytest.mark.parametrize(
    ("name", "cls", "error"),
    [
        ("", _Local, ValueError),
        (" local", _Local, ValueError),
        (None, _Local, ValueError),
        ("local", object, TypeError),
        ("local", _Local(), TypeError),
    ],
)
def test_register_refuses_bad_names_and_non_transports(name, cls, error):
    with pytest.raises(error):
        register_transport(name, cls)
    assert "local" not in kvbridge.core.registry.transport_names()


def test_the_seam_is_exported():
    import kvbridge.core

    assert kvbridge.register_transport is kvbridge.core.register_transport is register_transport
    assert kvbridge.unregister_transport is kvbridge.core.unregister_transport
    assert {"register_transport", "unregister_transport"} <= set(kvbridge.__all__)
    assert {"register_transport", "unregister_transport"} <= set(kvbridge.core.__all__)


# -- options ------------------------------------------------------------------------------------

#: Each installed transport, a typo of one of its options, the option meant, and every option.
TYPOS = {
    "mooncake": (
        "protcol",
        "protocol",
        "device_name, hostname, max_batch, max_in_flight, metadata_server, port_range, "
        "protocol, retries, timeout",
    ),
    "nixl": (
        "backend",
        "backends",
        "agent_name, backends, device_id, host, port_range, progress_delay_us, progress_thread, "
        "timeout, ucx",
    ),
    "cma": ("timout", "timeout", "allow_peers, retries, timeout"),
}


def _one_line(err: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(err.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize("name", sorted(TYPOS))
def test_a_mistyped_option_names_the_transport_a_close_match_and_its_options(name):
    """Through load_transport, the class itself (what the vLLM worker calls) and check_options
    (no engine started): the same one line, a kvbridge error (and a ValueError), not TypeError."""
    load_transport_class(name)  # the engine is installed: the options are what fails below
    typo, meant, valid = TYPOS[name]
    expected = (
        f"transport {name!r} has no option {typo!r} (did you mean {meant!r}?); its options are "
        f"{valid}"
    )
    for build in (
        lambda: kvbridge.load_transport(name, **{typo: 1}),
        lambda: load_transport_class(name)(timeout=5.0, **{typo: 1}),
        lambda: check_options(name, {typo: 1}),
    ):
        with pytest.raises(TransportOptionError) as err:
            build()
        assert _one_line(err) == expected
        assert isinstance(err.value, ValueError) and not isinstance(err.value, TypeError)


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("mooncake", {"max_batch": "1024"}, "option max_batch='1024' has type str; expected int"),
        ("mooncake", {"protocol": 5}, "option protocol=5 has type int; expected str"),
        ("cma", {"allow_peers": "yes"}, "option allow_peers='yes' has type str; expected bool"),
        ("cma", {"retries": True}, "option retries=True has type bool; expected int"),
        (
            "nixl",
            {"port_range": [7000, "7100"]},
            "option port_range=[7000, '7100'] has type list; expected tuple[int, int] | None "
            "(Expected `int`, got `str` - at `$[1]`)",
        ),
        ("nixl", {"ucx": ["TLS=tcp"]}, "option ucx=['TLS=tcp'] has type list; expected dict"),
    ],
)
def test_a_value_of_the_wrong_type_is_one_line(name, options, message):
    with pytest.raises(TransportOptionError) as err:
        kvbridge.load_transport(name, **options)
    assert _one_line(err).startswith(f"transport {name!r} {message}")


def test_several_unknown_options_and_options_of_every_kind_pass_through():
    with pytest.raises(TransportOptionError) as err:
        check_options("cma", {"timeout": 1, "x": 1, "retires": 0})
    assert _one_line(err) == (
        "transport 'cma' has no options 'x', 'retires' (did you mean 'retries'?); its options "
        "are allow_peers, retries, timeout"
    )
    # ints for floats, a string for nixl's backends, a list for a tuple: what JSON gives
    check_options("cma", {"timeout": 1, "retries": 0, "allow_peers": False})
    check_options("nixl", {"backends": "UCX", "port_range": [7000, 7100], "ucx": {"TLS": "tcp"}})
    with kvbridge.load_transport("cma", timeout=2) as transport:
        assert transport.timeout == 2.0
    check_options("no-such-transport", {"anything": 1})  # building it says what is wrong


class _Passing(_Local):
    """Takes options of its own and passes the rest to its parent's ``__init__``."""

    def __init__(self, *, extra: int = 0, **options: object) -> None:
        super().__init__(**options)  # type: ignore[arg-type]
        self.extra = extra


def test_options_passed_on_to_the_parent_class_count_and_registered_classes_are_checked(
    registered,
):
    register_transport("passing", _Passing)
    registered.append("passing")
    t = kvbridge.load_transport("passing", extra=1, label="y")
    assert (t.extra, t.label) == (1, "y")
    t.close()
    with pytest.raises(TransportOptionError) as err:
        kvbridge.load_transport("passing", lable="y")
    assert _one_line(err) == (
        "transport 'local' has no option 'lable' (did you mean 'label'?); its options are "
        "extra, label, timeout"
    )
    with pytest.raises(TransportOptionError, match="option extra='1' has type str; expected int"):
        _Passing(extra="1")
