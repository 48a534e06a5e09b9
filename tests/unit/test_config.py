"""The daemon configuration: the shipped sample is the defaults, and each layer (file, environment,
overrides) either applies or fails naming the key and where it came from."""

from __future__ import annotations

import tomllib
from pathlib import Path

import msgspec
import pytest

from apomesh.core.errors import DefinitionError
from apomesh.runtime.config import (
    GIB,
    SECTIONS,
    Config,
    DaemonConfig,
    HttpConfig,
    LivenessConfig,
    load_config,
    sample_config,
)

REPO = Path(__file__).resolve().parents[2]
SAMPLE_COPIES = [REPO / "conf" / "apomesh.toml", REPO / "src" / "apomesh" / "conf" / "apomesh.toml"]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "apomesh.toml"
    path.write_text(text, encoding="utf-8")
    return path


# -- the sample -----------------------------------------------------------------------------------


def test_the_repo_copy_of_the_sample_is_byte_identical_to_the_packaged_one() -> None:
    assert SAMPLE_COPIES[0].read_bytes() == SAMPLE_COPIES[1].read_bytes()
    assert sample_config().encode("utf-8") == SAMPLE_COPIES[1].read_bytes()


def test_the_sample_parses_to_exactly_the_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, sample_config()), env={}) == Config()


def test_the_sample_shows_every_key_of_every_section() -> None:
    sample = tomllib.loads(sample_config())
    assert list(sample) == [field.name for field in msgspec.structs.fields(Config)]
    assert set(SECTIONS) == set(sample)
    for section, cls in SECTIONS.items():
        assert set(sample[section]) == {field.name for field in msgspec.structs.fields(cls)}, (
            section
        )


def test_every_key_in_the_sample_has_a_comment_above_it_or_its_group() -> None:
    def is_key(line: str) -> bool:
        return bool(line) and not line.startswith(("#", "["))

    lines = sample_config().splitlines()
    for number, line in enumerate(lines):
        if is_key(line):
            above = number - 1
            while above >= 0 and is_key(lines[above]):
                above -= 1
            assert above >= 0 and lines[above].startswith("#"), f"{line!r} has no comment"


def test_no_file_and_no_environment_is_the_defaults() -> None:
    config = load_config(None, env={})
    assert config == Config()
    assert config.nats.embedded and config.daemon.workers == 2 and config.store.map_size == GIB


# -- layering -------------------------------------------------------------------------------------


def test_environment_overrides_convert_by_the_key_type(tmp_path: Path) -> None:
    path = write(tmp_path, "[nats]\nreplicas = 1\n[store]\nsync = true\n")
    config = load_config(
        path,
        env={
            "APOMESH_NATS_URLS": "nats://10.0.0.1:4222, nats://10.0.0.2:4222,",
            "APOMESH_NATS_REPLICAS": "3",
            "APOMESH_STORE_SYNC": "false",
            "APOMESH_LIVENESS_HEARTBEAT_INTERVAL": "0.25",
            "APOMESH_NATS_SYNC_INTERVAL": "always",
            "APOMESH_LIMITS_MAX_GOAL_BYTES": "1_000",
            "APOMESH_URL": "http://elsewhere:8750",  # a client setting, not daemon config
            "APOMESH_TOKEN": "secret",
            "PATH": "/usr/bin",
        },
    )
    assert config.nats.urls == ["nats://10.0.0.1:4222", "nats://10.0.0.2:4222"]
    assert config.nats.replicas == 3
    assert config.store.sync is False
    assert config.liveness.heartbeat_interval == 0.25
    assert config.nats.sync_interval == "always"
    assert config.limits.max_goal_bytes == 1000
    assert config.http == HttpConfig()


def test_an_empty_list_variable_clears_the_list(tmp_path: Path) -> None:
    path = write(tmp_path, '[plugins]\nblock = ["noisy"]\n')
    assert load_config(path, env={"APOMESH_PLUGINS_BLOCK": ""}).plugins.block == []


@pytest.mark.parametrize("text", ["1", "yes", "ON", "True"])
def test_boolean_variables_accept_the_usual_spellings(text: str) -> None:
    assert load_config(None, env={"APOMESH_STORE_SYNC": text}).store.sync is True


def test_explicit_overrides_beat_the_environment_and_none_means_not_given(tmp_path: Path) -> None:
    path = write(tmp_path, '[daemon]\ndata_dir = "/from/file"\nworkers = 5\n')
    config = load_config(
        path,
        env={"APOMESH_DAEMON_WORKERS": "7", "APOMESH_NATS_REPLICAS": "3"},
        overrides={
            "daemon": {"workers": 0, "workspace": None},
            "nats": {"replicas": None, "urls": ["nats://cli:4222"]},
        },
    )
    assert config.daemon.workers == 0
    assert config.daemon.data_dir == "/from/file"
    assert config.daemon.workspace == ""
    assert config.nats.replicas == 3
    assert config.nats.urls == ["nats://cli:4222"]


# -- errors name the key and its source ---------------------------------------------------------------


def test_a_wrong_type_in_the_file_names_the_file_and_key(tmp_path: Path) -> None:
    path = write(tmp_path, '[nats]\nreplicas = "three"\n')
    with pytest.raises(DefinitionError) as error:
        load_config(path, env={})
    assert error.value.where == f"{path} $.nats.replicas"
    assert "Expected `int`, got `str`" in str(error.value)


def test_an_unknown_key_in_the_file_names_it(tmp_path: Path) -> None:
    path = write(tmp_path, "[nats]\nreplica = 3\n")
    with pytest.raises(DefinitionError, match="unknown key") as error:
        load_config(path, env={})
    assert error.value.where == f"{path} $.nats.replica"


def test_an_unknown_section_or_a_top_level_key_names_it(tmp_path: Path) -> None:
    with pytest.raises(DefinitionError, match="unknown key") as error:
        load_config(write(tmp_path, "[natz]\nreplicas = 3\n"), env={})
    assert error.value.where.endswith(" $.natz")
    with pytest.raises(DefinitionError, match="unknown key") as error:
        load_config(write(tmp_path, "replicas = 3\n"), env={})
    assert error.value.where.endswith(" $.replicas")


def test_a_section_that_is_not_a_table_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DefinitionError) as error:
        load_config(write(tmp_path, "nats = 3\n"), env={})
    assert error.value.where.endswith(" $.nats")


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[nats]\nreplicas = 0\n", "$.nats.replicas"),
        ('[nats]\nsync_interval = "sometimes"\n', "$.nats.sync_interval"),
        ("[nats]\nurls = [4222]\n", "$.nats.urls[0]"),
        ("[liveness]\nheartbeat_interval = 0\n", "$.liveness.heartbeat_interval"),
        ("[store]\nmap_size = 4096\n", "$.store.map_size"),
        ('[http]\nauth = "maybe"\n', "$.http.auth"),
        ('[http]\nlisten = "8750"\n', "$.http.listen"),
        ('[http]\nlisten = "127.0.0.1:99999"\n', "$.http.listen"),
        ('[http]\ntls_cert = "cert.pem"\n', "$.http.tls_key"),
        ('[nats]\ntls_key = "key.pem"\n', "$.nats.tls_cert"),
    ],
)
def test_an_impossible_value_names_the_key(tmp_path: Path, text: str, key: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(DefinitionError) as error:
        load_config(path, env={})
    assert error.value.where == f"{path} {key}"


def test_a_bad_environment_value_names_the_variable() -> None:
    with pytest.raises(DefinitionError, match="three") as error:
        load_config(None, env={"APOMESH_NATS_REPLICAS": "three"})
    assert error.value.where == "env APOMESH_NATS_REPLICAS $.nats.replicas"
    with pytest.raises(DefinitionError, match="true/false") as error:
        load_config(None, env={"APOMESH_STORE_SYNC": "maybe"})
    assert error.value.where == "env APOMESH_STORE_SYNC $.store.sync"
    with pytest.raises(DefinitionError) as error:
        load_config(None, env={"APOMESH_NATS_REPLICAS": "0"})
    assert error.value.where == "env APOMESH_NATS_REPLICAS $.nats.replicas"


def test_an_unknown_key_in_a_known_section_of_the_environment_is_refused() -> None:
    with pytest.raises(DefinitionError, match="replicas") as error:
        load_config(None, env={"APOMESH_NATS_REPLICA": "3"})
    assert error.value.where == "env APOMESH_NATS_REPLICA"


def test_a_bad_override_names_the_overrides() -> None:
    with pytest.raises(DefinitionError) as error:
        load_config(None, env={}, overrides={"daemon": {"workers": "two"}})
    assert error.value.where == "overrides $.daemon.workers"
    with pytest.raises(DefinitionError) as error:
        load_config(None, env={}, overrides={"daemon": {"worker": 2}})
    assert error.value.where == "overrides $.daemon.worker"


def test_a_file_that_is_not_toml_or_not_there_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[nats\nreplicas = 3\n")
    with pytest.raises(DefinitionError, match="not valid TOML") as error:
        load_config(path, env={})
    assert error.value.where == str(path)
    missing = tmp_path / "missing.toml"
    with pytest.raises(DefinitionError, match="cannot read") as error:
        load_config(missing, env={})
    assert error.value.where == str(missing)


# -- derived values -----------------------------------------------------------------------------------


def test_paths_default_under_the_data_dir_relative_to_the_start_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    config = Config()
    assert config.daemon.data_path() == tmp_path / ".apomesh"
    assert config.daemon.workspace_path() == tmp_path / ".apomesh" / "workspace"
    assert config.nats_store_path() == tmp_path / ".apomesh" / "nats"
    moved = DaemonConfig(data_dir="~/state", workspace="work")
    assert moved.data_path() == Path.home() / "state"
    assert moved.workspace_path() == tmp_path / "work"


def test_auth_is_on_by_default_on_loopback_too() -> None:
    for listen in ("127.0.0.1:8750", "localhost:8750", "[::1]:8750", "0.0.0.0:8750"):
        assert HttpConfig(listen=listen).auth_required() is True
    assert HttpConfig(auth="off").auth_required() is False
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"auth": "auto"}, HttpConfig)


def test_the_api_answers_the_listen_host_the_loopback_names_and_allowed_hosts() -> None:
    assert HttpConfig(listen="[::1]:9000").host_names() == ["::1", "127.0.0.1", "localhost"]
    names = HttpConfig(listen="10.0.0.5:8750", allowed_hosts=["apomesh.internal"]).host_names()
    assert names == ["10.0.0.5", "127.0.0.1", "localhost", "::1", "apomesh.internal"]


def test_ipv6_listen_addresses_split_into_host_and_port() -> None:
    assert HttpConfig(listen="[::1]:9000").host_port() == ("::1", 9000)
    assert HttpConfig().host_port() == ("127.0.0.1", 8750)


def test_a_worker_is_lost_after_the_missed_beats() -> None:
    assert LivenessConfig(heartbeat_interval=0.5, missed_beats=4).lost_after == 2.0


# -- model provider credentials -------------------------------------------------------------------


def test_provider_credentials_replace_the_default_and_never_name_an_apomesh_variable(
    tmp_path: Path,
) -> None:
    path = write(
        tmp_path,
        '[providers.openai.credentials.local]\nbase_url = "http://127.0.0.1:11434/v1"\n',
    )
    credentials = load_config(path, env={}).providers.openai.credentials
    assert list(credentials) == ["local"] and credentials["local"].api_key_env == ""
    path = write(
        tmp_path,
        '[providers.openai.credentials.x]\nbase_url = "http://h/v1"\n'
        'api_key_env = "APOMESH_HTTP_TOKEN"\n',
    )
    with pytest.raises(DefinitionError) as caught:
        load_config(path, env={})
    assert caught.value.where.endswith("$.providers.openai.credentials.x.api_key_env")
    path = write(tmp_path, '[providers.openai.credentials.x]\nbase_url = "file:///etc"\n')
    with pytest.raises(DefinitionError) as caught:
        load_config(path, env={})
    assert caught.value.where.endswith("$.providers.openai.credentials.x.base_url")


def test_a_control_certificate_needs_its_key(tmp_path: Path) -> None:
    with pytest.raises(DefinitionError, match="control_tls_cert and control_tls_key go together"):
        load_config(write(tmp_path, '[nats]\ncontrol_tls_cert = "c.crt"\n'), env={})


@pytest.mark.parametrize(
    ("replicated", "urls", "on"),
    [
        ("auto", ["nats://10.0.0.1:4222"], True),
        ("auto", [], False),
        ("on", [], True),
        ("off", ["nats://10.0.0.1:4222"], False),
    ],
)
def test_the_replicated_state_store_is_on_for_a_cluster_deployment_by_default(
    replicated: str, urls: list[str], on: bool
) -> None:
    from apomesh.runtime.config import StoreConfig

    assert Config().store.replicated == "auto"
    assert StoreConfig(replicated=replicated).replicated_with(urls) is on  # type: ignore[arg-type]
    env = {"APOMESH_STORE_REPLICATED": replicated}
    assert load_config(None, env=env).store.replicated == replicated
