"""Experiment files: decoding, errors that name file/field/type, overrides, diffs for hot reload."""

import tomllib

import msgspec
import pytest

from actors import REGISTRY
from pipeline.core import config as cfg
from pipeline.core.runtime import make_resolver

resolve = make_resolver(REGISTRY)

BASE = """
[experiment]
name = "t"
[graph]
actors = { source = "actors.toy:Source", scale = "actors.toy:Scale", sink = "actors.toy:Sink" }
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
    from actors.toy import ScaleSettings, SinkSettings, SourceSettings
    assert exp.sections["source"] == SourceSettings(count=3)
    assert exp.sections["scale"] == ScaleSettings(factor=2.0)
    assert exp.sections["sink"] == SinkSettings()  # missing section -> defaults
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
        load(tmp_path, BASE.replace('sink = "actors.toy:Sink"', 'sink = "toy.nope"'))
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


def test_errors_suggest_the_field_and_list_the_allowed_values(tmp_path):
    """A misspelt field gets the close names (or the section's fields), a wrong choice the allowed values, and an
    override is blamed as the --set it came from, also when its misspelt part is not its last."""
    with pytest.raises(cfg.ConfigError) as e:
        load(tmp_path, BASE.replace("factor = 2.0", "factr = 2.0"))
    assert str(e.value).endswith("[scale]: object contains unknown field factr; did you mean factor?")
    with pytest.raises(cfg.ConfigError) as e:
        load(tmp_path, BASE.replace("factor = 2.0", "zzz = 2.0"))
    assert str(e.value).endswith("unknown field zzz; its fields are factor, mode")
    for bad in ["scale.factr=3", "scale.factr.deep=3"]:
        with pytest.raises(cfg.ConfigError) as e:
            load(tmp_path, BASE, [bad])
        assert str(e.value).startswith(f"--set {bad}: object contains unknown field factr; did you mean factor?")
    quickstart = (cfg.CONFIG_DIR / "quickstart.toml").read_text()
    with pytest.raises(cfg.ConfigError) as e:
        load(tmp_path, quickstart, ['scheduler.mode="mixx"'])
    assert str(e.value).startswith('--set scheduler.mode="mixx": invalid enum value \'mixx\'; allowed: single, mix, '
                                   "scaling (field [scheduler].mode in ")
    with pytest.raises(cfg.ConfigError) as e:  # nested: the struct at the error's path gives the names
        load(tmp_path, quickstart, ["learner.train.lrr=1e-5"])
    assert str(e.value).startswith("--set learner.train.lrr=1e-5: object contains unknown field lrr; did you mean "
                                   "optimizer.lr?")
    with pytest.raises(cfg.ConfigError, match=r"unknown field lr; it is in one of its tables: optimizer.lr"):
        load(tmp_path, quickstart, ["learner.train.lr=1e-5"])  # a stage's settings are nested by concern


@pytest.mark.parametrize("sets, says", [
    (["learner.fsdp=true"], ("[learner].fsdp = true applies to learner ranks, and processes = 1 runs the learner in "
                            "this process: set [learner].processes to the number of ranks (from --set learner.fsdp=true)")),
    (['learner.gpus="0,1"'], '[learner].gpus = "0,1" applies to learner ranks'),
    (["learner.processes=2", 'learner.gpus="0;1"'], 'expected CUDA device ids separated by commas, e.g. "0,1"'),
    (["learner.processes=3", 'learner.gpus="0,1"'], ('[learner].gpus = "0,1" names 2 device(s) for processes = 3: one '
                                                     "per rank (from --set learner.gpus=\"0,1\")")),
])
def test_learner_rank_settings_without_ranks_or_with_too_few_gpus_are_refused(tmp_path, sets, says):
    """fsdp and gpus only mean something to learner ranks: with processes = 1 they were silently ignored."""
    with pytest.raises(cfg.ConfigError) as e:
        load(tmp_path, (cfg.CONFIG_DIR / "quickstart.toml").read_text(), sets)
    assert says in str(e.value)


def test_the_built_in_qwen_renderer_is_refused_for_another_model_family(tmp_path):
    """Qwen ids sent to a Llama model would train garbage without an error anywhere: refused at validation when the
    model folder says its family; a folder not built yet, a Qwen one, or the model's own template pass."""
    quickstart = (cfg.CONFIG_DIR / "quickstart.toml").read_text()
    model = tmp_path / "llama"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(cfg.ConfigError) as e:
        load(tmp_path, quickstart, [f'run.model="{model}"', "experiment.build_model={}"])
    assert f'[proxy.engine].renderer = "qwen3" is the built-in Qwen3 chat template and tokenizer, but the model ({model}) ' \
           'is a "llama" model' in str(e.value) and f'Set [proxy.engine].renderer = "{model}"' in str(e.value)
    load(tmp_path, quickstart, [f'run.model="{model}"', "experiment.build_model={}", f'proxy.engine.renderer="{model}"'])
    (model / "config.json").write_text('{"model_type": "qwen3"}')
    load(tmp_path, quickstart, [f'run.model="{model}"', "experiment.build_model={}"])
    load(tmp_path, quickstart, [f'run.model="{tmp_path / "not-built-yet"}"'])


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


# ------------------------------------------------------------------------ bounds and cross-section checks
def quickstart(overrides=()):
    return cfg.load_experiment("quickstart", resolve, list(overrides))


@pytest.mark.parametrize(("override", "field", "bound"), [
    ("run.groups_per_step=0", "[run].groups_per_step", ">= 1"),
    ("run.steps=-1", "[run].steps", ">= 0"),
    ("sandbox.concurrency=0", "[sandbox].concurrency", ">= 1"),
    ("sandbox.concurrency=-3", "[sandbox].concurrency", ">= 1"),
    ("scheduler.group_size=0", "[scheduler].group_size", ">= 1"),
    ("scheduler.temperature=-1.0", "[scheduler].temperature", ">= 0"),
    ("scheduler.timeout_s=0", "[scheduler].timeout_s", "> 0"),
    ("scheduler.max_groups_in_flight=0", "[scheduler].max_groups_in_flight", ">= 1"),
    ("learner.train.optimizer.lr=-1e-3", "[learner].train.optimizer.lr", "> 0"),
    ("learner.sft.optimizer.lr=0", "[learner].sft.optimizer.lr", "> 0"),
    ("collector.settle_interval_s=0", "[collector].settle_interval_s", "> 0"),
    ("proxy.keepalive_s=30", "[proxy].keepalive_s", "<= 15"),
    ("graph.queue_size=0", "[graph].queue_size", ">= 1"),
])
def test_numeric_bounds_name_the_field(override, field, bound):
    with pytest.raises(cfg.ConfigError) as e:
        quickstart([override])
    msg = str(e.value)
    assert f"--set {override}" in msg and field in msg and bound in msg, msg


def test_cross_section_checks_name_both_fields():
    with pytest.raises(cfg.ConfigError, match=r"\[scheduler\].max_new_tokens = 4096 .*\[proxy\].context_len = 2048"):
        quickstart(["scheduler.max_new_tokens=4096"])
    with pytest.raises(cfg.ConfigError, match=r"\[scheduler\].group_size = 1 .*\[learner.train\].advantage"):
        quickstart(["scheduler.group_size=1"])
    quickstart(["scheduler.group_size=1", 'learner.train.objective.advantage="ppo"'])  # PPO needs no group
    with pytest.raises(cfg.ConfigError, match=r"\[scheduler\].temperature = 0 is greedy .*\[learner\] cannot"):
        quickstart(["scheduler.temperature=0"])
    quickstart(["scheduler.temperature=0", "run.steps=0"])  # a cold start only: no sampled rollout is trained
    with pytest.raises(cfg.ConfigError, match=r"\[run\].steps = 0 and \[scheduler\].sft_groups = 0: nothing"):
        quickstart(["run.steps=0", "scheduler.sft_groups=0"])
    with pytest.raises(cfg.ConfigError, match=r"\[scheduler\].tasks: task folder '/no/such' does not exist"):
        quickstart(['scheduler.tasks.tasks="/no/such"'])
    with pytest.raises(cfg.ConfigError, match=r"unknown built-in task families \['nope'\]"):
        quickstart(['scheduler.tasks.tasks="builtin:nope"'])
    with pytest.raises(cfg.ConfigError, match=r"\[run\].model: the embedded engine .*serves the policy"):
        quickstart(['run.model=""'])


def test_distributed_weight_sync_needs_the_engines_edge():
    quickstart(['learner.weight_sync="distributed"'])  # the shipped configs have the edge
    raw = quickstart().to_dict()  # the preset spelled out: a custom graph
    raw["graph"]["edges"].remove("proxy.engines -> learner")
    cfg.load_experiment(raw, resolve)  # disk: no edge needed
    with pytest.raises(cfg.ConfigError, match=r'\[learner\].weight_sync = "distributed" needs .*"<proxy>.engines -> '
                                              r'learner" to \[graph\].edges'):
        cfg.load_experiment(raw, resolve, ['learner.weight_sync="distributed"'])


def test_dynamic_sampling_needs_the_resample_edge_and_grpo():
    quickstart(["run.dynamic_sampling=2"])  # the shipped configs have the edge
    with pytest.raises(cfg.ConfigError, match=r"dynamic_sampling .*\[learner.train.objective\].advantage is \"ppo\""):
        quickstart(["run.dynamic_sampling=2", 'learner.train.objective.advantage="ppo"'])
    raw = quickstart().to_dict()  # the preset spelled out: a custom graph
    raw["graph"]["edges"].remove("learner.resample -> scheduler")
    cfg.load_experiment(raw, resolve)  # off: no edge needed
    with pytest.raises(cfg.ConfigError, match=r'dynamic_sampling = 2 .*add "learner.resample -> <scheduler>"'):
        cfg.load_experiment(raw, resolve, ["run.dynamic_sampling=2"])


def test_fields_of_run_are_set_only_in_run():
    with pytest.raises(cfg.ConfigError, match=r"learner.steps=3: .*unknown field steps; it is set once for every actor, in \[run\]"):
        quickstart(["learner.steps=3"])
    with pytest.raises(cfg.ConfigError, match=r"proxy.engine.model=.*unknown field model; it is set once for every "
                                              r"actor, in \[run\]"):
        quickstart(['proxy.engine.model="/m"'])


def test_run_reload_is_offered_to_every_actor(tmp_path):
    base = BASE + "\n[run]\nmax_staleness = 1\n"
    old = load(tmp_path, base)
    d = cfg.diff(old, load(tmp_path, base.replace("max_staleness = 1", "max_staleness = 3")))
    assert d.changes == {"run": {"max_staleness": 3}} and not d.refused
    d = cfg.diff(old, load(tmp_path, base + "steps = 4\n"))
    assert d.refused == ["[run].steps"]


def test_distributed_weight_sync_with_learner_ranks_is_refused():
    quickstart(["learner.processes=2"])  # ranks with the disk path
    with pytest.raises(cfg.ConfigError, match=r'weight_sync = "distributed" with processes = 2: .*use weight_sync = '
                                              r'"disk" with ranks'):
        quickstart(['learner.weight_sync="distributed"', "learner.processes=2"])


# Settings a careless user (or a typo) gives, which a run used to accept and then fail on, loop on, or train NaNs
# with: each is refused by --validate, naming the field.
@pytest.mark.parametrize(("override", "says"), [
    ("learner.train.objective.entropy_coef=nan", "[learner].train.objective.entropy_coef = nan: settings must be finite"),
    ("learner.train.optimizer.lr=inf", "[learner].train.optimizer.lr = inf: settings must be finite"),
    ("learner.train.objective.clip_high=inf", "[learner].train.objective.clip_high = inf"),
    ("learner.train.objective.tis_cap=inf", "[learner].train.objective.tis_cap = inf"),
    ("eval.threshold=nan", "[eval].threshold = nan"),
    ("learner.train.optimizer.betas=[1.5, -1]", "betas"),
    ('learner.train.objective.train_statuses=["bogus"]', "train_statuses"),
    ("graph.stop_after=[]", "[graph].stop_after is empty, and the edges make a cycle"),
    ("graph.inbox_sizes.nosuch=5", 'inbox_sizes names actor "nosuch"'),
    ('scheduler.harness="whtiebox"', 'unknown harness "whtiebox"'),
    ('scheduler.harness="whitebox:S9T0O0C0W0"', "S9T0O0C0W0"),
    # a variant a harness does not have used to be dropped silently: the run trained another configuration
    ('scheduler.harness="codex:lean"', 'harness "codex:lean": codex has no variants; name it "codex"'),
    ('scheduler.harness="claude-code:bare"', 'harness "claude-code:bare": no variant "bare"; its variants: lean'),
    ('eval.harnesses=["claude-code:fat"]', '[eval].harnesses: harness "claude-code:fat": no variant "fat"'),
    ('eval.harnesses=["whtiebox"]', '[eval].harnesses: unknown harness "whtiebox"'),
    ("proxy.engine.max_running_requests=0", "max_running_requests"),
    ("proxy.engine.context_len=-5", "context_len"),
    ("eval.ks=[]", "ks"),
    ("sandbox.local.cpu_seconds=0", "cpu_seconds"),
    ('sandbox.local.file_size="abc"', "file_size"),
    ('sandbox.backend="docker"', None),  # valid: the checks below change one docker field each
    ('sandbox.docker.user="0:0"', "non-root"),
    ('sandbox.docker.storage="abc"', "storage"),
    ('sandbox.docker.memory="4096g"', None),  # over this machine: refused before a run (tests/cli/test_preflight.py)
])
def test_settings_that_would_break_a_run_are_refused(override, says):
    sets = [override]
    if override.startswith("sandbox.docker"):
        sets = ['sandbox.backend="docker"', override]
    if says is None:
        quickstart(sets)
        return
    with pytest.raises(cfg.ConfigError) as e:
        quickstart(sets)
    assert says in str(e.value), str(e.value)


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    p = tmp_path / "latin1.toml"
    p.write_bytes('[experiment]\nname = "caf\xe9"\n'.encode("latin-1"))
    with pytest.raises(cfg.ConfigError, match=r"latin1.toml: not UTF-8 text \(byte \d+ is b'\\xe9'\)"):
        cfg.load_experiment(str(p), resolve)


# ------------------------------------------------------------------------------------------------ graph presets
SCRIPTED = '[run]\nmodel = "m"\n[proxy.engine]\nkind = "scripted"\nscript = "configs/scripts/hello.json"\n'


def test_a_file_without_graph_trains_with_the_train_preset(tmp_path):
    from pipeline.core import graphs
    exp = load(tmp_path, '[experiment]\nname = "mine"\n' + SCRIPTED)
    assert exp.preset == "train" and exp.graph.actors == graphs.TRAIN_ACTORS
    assert exp.graph.edges == graphs.TRAIN_EDGES and exp.graph.stop_after == ["learner"]
    # an [eval] section adds the evaluator; rounds during training make the run wait for the last one
    ev = '\n[eval]\nharnesses = ["whitebox"]\n'
    exp = load(tmp_path, SCRIPTED + ev)
    assert exp.graph.actors["eval"] == "evaluator" and exp.graph.stop_after == ["learner"]
    assert set(graphs.EVAL_EDGES) <= set(exp.graph.edges)
    assert load(tmp_path, SCRIPTED + ev + "every_steps = 5\n").graph.stop_after == ["learner", "eval"]
    # beside a preset, [graph] may still size the queues and say when the run ends
    exp = load(tmp_path, SCRIPTED + '[graph]\nqueue_size = 7\ninbox_sizes = { learner = 2 }\n')
    assert (exp.preset, exp.graph.queue_size, exp.graph.inbox_sizes) == ("train", 7, {"learner": 2})


def test_serve_toy_and_eval_presets(tmp_path):
    from pipeline.cli.evaluate import eval_experiment
    assert load(tmp_path, SCRIPTED + '[graph]\npreset = "serve"\n').graph.actors == {"proxy": "proxy"}
    toy = load(tmp_path, '[graph]\npreset = "toy"\n[source]\ncount = 2\n')
    assert toy.graph.parsed_edges() == [("source", "out", "scale"), ("scale", "out", "sink")]
    # the eval preset is what run.py --eval derives from a training file
    ev = load(tmp_path, SCRIPTED + '[graph]\npreset = "eval"\n[eval]\nharnesses = ["whitebox"]\n')
    derived, _ = eval_experiment(quickstart(), resolve)
    assert (ev.graph.actors, sorted(ev.graph.edges), ev.graph.stop_after) == (
        derived.graph.actors, sorted(derived.graph.edges), derived.graph.stop_after)
    assert ev.sections["eval"].standalone and derived.preset == "eval"


@pytest.mark.parametrize(("text", "match"), [
    ('[graph]\npreset = "train"\nactors = { proxy = "proxy" }\n', r"both preset = 'train' and actors"),
    ('[graph]\nedges = ["a.b -> c"]\n', r"\[graph\].edges without \[graph\].actors"),
    ('[graph]\npreset = "trian"\n', r"\[graph\].preset = 'trian': expected one of train, eval, serve, toy"),
])
def test_preset_mistakes_are_named(tmp_path, text, match):
    with pytest.raises(cfg.ConfigError, match=match):
        load(tmp_path, text)


def test_no_shipped_config_restates_a_preset():
    for path in sorted(cfg.CONFIG_DIR.glob("*.toml")):
        graph = tomllib.loads(path.read_text()).get("graph", {})
        assert "edges" not in graph and "actors" not in graph, f"{path.name} spells out a graph; name a preset"
        cfg.load_experiment(path, resolve)


def test_one_place_per_setting():
    """No settings struct copies another's fields (a mirror someone must keep in step by hand): among every msgspec
    Struct named *Settings or *Config in pipeline/ and actors/, and every config Section, no two share 4 or more
    field names making up three quarters of the smaller one (the mirrored proxy settings shared 12 of 14)."""
    import importlib
    import inspect
    import pkgutil

    import msgspec

    import actors
    import pipeline

    found: dict[str, type] = {}
    for pkg in (pipeline, actors):
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if info.name.endswith("__main__"):
                continue
            mod = importlib.import_module(info.name)
            for name, obj in vars(mod).items():
                if (inspect.isclass(obj) and issubclass(obj, msgspec.Struct) and obj.__module__ == mod.__name__
                        and (name.endswith(("Settings", "Config")) or issubclass(obj, cfg.Section))):
                    found[f"{obj.__module__}.{name}"] = obj
    assert len(found) > 20, sorted(found)
    fields = {where: {f.name for f in msgspec.structs.fields(s)} for where, s in found.items()}
    names = sorted(fields)
    # a subclass holds its base's fields by inheritance ([sandbox] is SandboxCommon and the pool's own): one place
    related = {(a, b) for a in names for b in names if issubclass(found[a], found[b]) or issubclass(found[b], found[a])}
    mirrored = [(a, b, sorted(fields[a] & fields[b])) for i, a in enumerate(names) for b in names[i + 1:]
                if (a, b) not in related and len(fields[a] & fields[b]) >= 4
                and len(fields[a] & fields[b]) >= 0.75 * min(len(fields[a]), len(fields[b]))]
    assert not mirrored, f"settings structs that copy each other's fields: {mirrored}"


def test_the_experiment_seed_seeds_every_actor_that_sets_none():
    exp = quickstart(["experiment.seed=3", "learner.sft.seed=5"])
    seeds = (exp.sections["scheduler"].seed, exp.sections["learner"].train.seed, exp.sections["learner"].sft.seed,
             exp.sections["eval"].seed)
    assert seeds == (3, 3, 5, 3)  # a section's own seed wins
    assert exp.sections["learner"].sft.optimizer.lr == 1e-3  # the stage's other defaults are untouched
    # task sets are data, not the run's randomness: their seeds stay
    assert exp.sections["scheduler"].tasks.seed == quickstart().sections["scheduler"].tasks.seed


def test_the_proxy_admits_no_longer_prompts_than_its_engine_holds():
    quickstart(["proxy.context_len=4096", "proxy.engine.context_len=4096"])
    with pytest.raises(cfg.ConfigError, match=r"\[proxy\].context_len = 32768 admits prompts the engine cannot hold: "
                                              r"\[proxy.engine\].context_len = 4096"):
        quickstart(["proxy.context_len=32768", "proxy.engine.context_len=4096"])


def test_a_teacher_engine_records_and_is_never_trained_on(tmp_path):
    teacher = 'proxy.engine={kind="openai", url="http://127.0.0.1:9/v1", served_model="t"}'
    with pytest.raises(cfg.ConfigError, match=r'kind = "openai".*\[learner\] in the graph.*sft_recordings'):
        quickstart([teacher])
    from pipeline.cli.evaluate import eval_experiment  # --eval checks the graph it derives: no learner there

    exp, what = eval_experiment(cfg.load_experiment("quickstart", resolve, [teacher], check=False), resolve)
    assert exp.kind_section("learner") is None and what == "the teacher 't' at http://127.0.0.1:9/v1"
    with pytest.raises(cfg.ConfigError, match="workers cannot reach"):
        cfg.load_experiment("serve", resolve, [teacher, "proxy.workers=2"])
    with pytest.raises(cfg.ConfigError, match=r"needs url .* and served_model"):
        cfg.load_experiment("serve", resolve, ['proxy.engine={kind="openai", url="http://127.0.0.1:9/v1"}'])
    with pytest.raises(cfg.ConfigError, match=r"api_key_env = 'BRIDLE_TEST_UNSET_KEY': the environment variable is"):
        cfg.load_experiment("serve", resolve, [teacher.replace("}", ', api_key_env="BRIDLE_TEST_UNSET_KEY"}')])


def test_recorded_runs_are_demonstrations_enough_for_a_cold_start(tmp_path):
    cold = ["run.steps=0", "scheduler.sft_groups=0"]
    with pytest.raises(cfg.ConfigError, match="nothing to train"):
        quickstart(cold)
    log = tmp_path / "events.msgpack"
    with pytest.raises(cfg.ConfigError, match=r"\[scheduler\].sft_recordings: logs: no such file"):
        quickstart([*cold, f'scheduler.sft_recordings={{logs=["{log}"]}}'])
    log.write_bytes(b"")
    with pytest.raises(cfg.ConfigError, match=r"is not a bridle event log"):
        quickstart([*cold, f'scheduler.sft_recordings={{logs=["{log}"]}}'])
    from pipeline.core.eventlog import MAGIC

    log.write_bytes(MAGIC)
    quickstart([*cold, f'scheduler.sft_recordings={{logs=["{log}"], min_reward=0.5}}'])


def test_the_engine_kind_selects_its_fields():
    """A field another kind reads is refused, naming that kind and how to switch kinds (replace the table)."""
    with pytest.raises(cfg.ConfigError, match=r'\[proxy.engine\].threads is read by kind = "embedded" only, and '
                                              r'\[proxy.engine\].kind = "sglang".*replace the whole table.*'
                                              r'\(from --set proxy.engine.kind="sglang"\)'):
        quickstart(['proxy.engine.kind="sglang"'])
    with pytest.raises(cfg.ConfigError, match=r'\[proxy.engine\].url is read by kind = "sglang" or "openai" only'):
        quickstart(['proxy.engine.url="http://127.0.0.1:30000"'])
    exp = quickstart(['proxy.engine={kind="sglang", url="http://127.0.0.1:30000"}'])
    assert exp.sections["proxy"].engine.kind == "sglang" and exp.sections["proxy"].engine.threads == 0
    from pipeline.serving.factory import COMMON_FIELDS, KIND_FIELDS, EngineSettings

    named = COMMON_FIELDS.union(*KIND_FIELDS.values())
    assert named == {f.name for f in msgspec.structs.fields(EngineSettings)}  # every field belongs somewhere


def test_the_sandbox_backend_selects_its_tables():
    """What every backend reads is [sandbox]'s own, so switching backends with --set needs nothing else; a table of
    a backend the pool does not use is refused, naming the backend that reads it."""
    exp = quickstart(['sandbox.backend="docker"'])
    assert exp.sections["sandbox"].max_turns == 4  # the quickstart's, kept across the switch
    with pytest.raises(cfg.ConfigError, match=r'\[sandbox.docker\] cpus is set, but \[sandbox.docker\] is read by '
                                              r'backend = "docker" or "ray" only, and \[sandbox\].backend = "local".*'
                                              r"\(from --set sandbox.docker.cpus=2.0\)"):
        quickstart(['sandbox.docker.cpus=2.0'])
    with pytest.raises(cfg.ConfigError, match=r'\[sandbox.local\] open_files is set, but .* backend = "local" only'):
        quickstart(['sandbox.backend="docker"', "sandbox.local.open_files=10"])
    with pytest.raises(cfg.ConfigError, match=r"unknown field max_turns; it is \[sandbox\]'s own: max_turns"):
        quickstart(["sandbox.local.max_turns=3"])  # one place: [sandbox] max_turns
    assert quickstart(['sandbox.backend="docker"', "sandbox.warm=2"]).sections["sandbox"].warm == 2
    with pytest.raises(cfg.ConfigError, match=r'\[sandbox\] warm = 2: the ray backend has no warm pool yet'):
        quickstart(['sandbox.backend="ray"', "sandbox.warm=2"])


def test_every_setting_says_what_it_is():
    """Each field of every settings struct has its line of doc beside it (a comment on its line or just above), so
    the source a user is pointed at explains the setting. Harbor's task.toml schema (tasks.py) is Harbor's."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    missing = []
    for path in [*sorted((root / "pipeline").rglob("*.py")), *sorted((root / "actors").rglob("*.py"))]:
        if path.name == "tasks.py":
            continue
        lines = path.read_text(encoding="utf-8").splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            bases = [ast.unparse(b) for b in node.bases] if isinstance(node, ast.ClassDef) else []
            if not (isinstance(node, ast.ClassDef) and (node.name.endswith("Settings") or "Section" in bases)):
                continue
            for st in node.body:
                if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                    above = lines[st.lineno - 2].strip()
                    if "#" not in lines[st.end_lineno - 1] and not above.startswith("#"):
                        missing.append(f"{path.relative_to(root)}:{st.lineno} {node.name}.{st.target.id}")
    assert not missing, "settings without a line of doc:\n" + "\n".join(missing)
