"""Experiment files: decoding, errors that name file/field/type, overrides, diffs for hot reload."""

import pytest

from actors import REGISTRY
from pipeline.core import config as cfg
from pipeline.core.runtime import make_resolver

resolve = make_resolver(REGISTRY)

BASE = """
[experiment]
name = "t"
[graph]
actors = { source = "toy.source", scale = "toy.scale", sink = "toy.sink" }
edges = ["source.out -> scale", "scale.out -> sink"]
[source]
count = 3
[scale]
factor = 2.0
"""


def write(tmp_path, text, name="exp.toml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def load(tmp_path, text, overrides=()):
    return cfg.load_experiment(write(tmp_path, text), resolve, list(overrides))


def test_decodes_sections_into_actor_config_types(tmp_path):
    exp = load(tmp_path, BASE)
    from actors.toy import ScaleConfig, SinkConfig, SourceConfig
    assert exp.sections["source"] == SourceConfig(count=3)
    assert exp.sections["scale"] == ScaleConfig(factor=2.0)
    assert exp.sections["sink"] == SinkConfig()  # missing section -> defaults
    assert exp.graph.parsed_edges() == [("source", "out", "scale"), ("scale", "out", "sink")]
    assert exp.name == "t"


def test_wrong_type_names_file_section_field_and_type(tmp_path):
    with pytest.raises(cfg.ConfigError) as e:
        load(tmp_path, BASE.replace("factor = 2.0", 'factor = "big"'))
    msg = str(e.value)
    assert "exp.toml" in msg and "[scale].factor" in msg and "expected float, got str" in msg


def test_unknown_field_and_unknown_section(tmp_path):
    with pytest.raises(cfg.ConfigError, match=r"\[scale\].*unknown field.*factr"):
        load(tmp_path, BASE.replace("factor = 2.0", "factr = 2.0"))
    with pytest.raises(cfg.ConfigError, match=r"unknown section \[learner\].*scale, sink, source"):
        load(tmp_path, BASE + "\n[learner]\nlr = 1\n")


def test_graph_errors(tmp_path):
    with pytest.raises(cfg.ConfigError, match='names actor "nope"'):
        load(tmp_path, BASE.replace('"scale.out -> sink"', '"scale.out -> nope"'))
    with pytest.raises(cfg.ConfigError, match='has no output "bad"; its outputs are out, metrics'):
        load(tmp_path, BASE.replace('"scale.out -> sink"', '"scale.bad -> sink"'))
    with pytest.raises(cfg.ConfigError, match="not of the form"):
        load(tmp_path, BASE.replace('"scale.out -> sink"', '"scale -> sink"'))
    with pytest.raises(cfg.ConfigError, match='unknown actor kind "toy.nope"'):
        load(tmp_path, BASE.replace('sink = "toy.sink"', 'sink = "toy.nope"'))
    with pytest.raises(cfg.ConfigError, match="not valid TOML"):
        load(tmp_path, BASE + "\n[[[")


def test_overrides_are_typed(tmp_path):
    exp = load(tmp_path, BASE, ["scale.factor=3", "source.interval_s=1e-3", 'sink.path="/tmp/x"'])
    assert exp.sections["scale"].factor == 3.0 and exp.sections["source"].interval_s == 0.001
    assert exp.sections["sink"].path == "/tmp/x"
    with pytest.raises(cfg.ConfigError) as e:
        load(tmp_path, BASE, ["source.count=many"])
    assert "--set source.count=many" in str(e.value) and "expected int, got str" in str(e.value)
    with pytest.raises(cfg.ConfigError, match="section.field=value"):
        load(tmp_path, BASE, ["count"])


def test_experiment_name_resolution(tmp_path):
    assert cfg.resolve_experiment_path("toy").name == "toy.toml"
    with pytest.raises(cfg.ConfigError, match="known experiments: .*toy"):
        cfg.resolve_experiment_path("no-such-experiment")


def test_resolved_config_round_trips_through_toml(tmp_path):
    exp = load(tmp_path, BASE, ["scale.factor=5"])
    again = load(tmp_path, exp.to_toml())
    assert again.to_dict() == exp.to_dict()


def test_diff_reloadable_fixed_and_graph(tmp_path):
    old = load(tmp_path, BASE)
    d = cfg.diff(old, load(tmp_path, BASE.replace("factor = 2.0", "factor = 4.0")))
    assert d.changes == {"scale": {"factor": 4.0}} and not d.refused
    d = cfg.diff(old, load(tmp_path, BASE.replace("factor = 2.0", 'factor = 4.0\nmode = "add"')))
    assert d.refused == ["[scale].mode"] and d.changes == {}  # nothing half-applied
    d = cfg.diff(old, load(tmp_path, BASE.replace("count = 3", "count = 4")))
    assert d.refused == ["[source].count"]
    d = cfg.diff(old, load(tmp_path, BASE.replace("[graph]", "[graph]\nqueue_size = 3")))
    assert d.refused == ["[graph].queue_size"]
    assert cfg.diff(old, load(tmp_path, BASE)).empty


def test_every_shipped_experiment_validates():
    for path in sorted(cfg.CONFIG_DIR.glob("*.toml")):
        exp = cfg.load_experiment(path, resolve)
        assert exp.graph.actors, path
