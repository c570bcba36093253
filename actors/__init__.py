"""One module per actor; each is thin: receive, call the library in ``pipeline``, send."""

# kind -> "module:Class". An experiment's [graph].actors names kinds from here (or "module:Class" directly, as the
# demo actors in actors/toy.py are named by configs/toy.toml).
REGISTRY: dict[str, str] = {
    "proxy": "actors.proxy:ProxyActor",
    "scheduler": "actors.scheduler:Scheduler",
    "sandbox": "actors.sandbox:SandboxPool",
    "collector": "actors.collector:Collector",
    "tree": "actors.tree:TreeBuilder",
    "learner": "actors.learner:LearnerActor",
    "monitor": "actors.monitor:Monitor",
    "evaluator": "actors.evaluator:Evaluator",
}
