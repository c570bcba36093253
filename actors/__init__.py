"""One module per actor; each is thin: receive, call the library in ``pipeline``, send."""

# kind -> "module:Class". An experiment's [graph].actors names kinds from here (or "module:Class" directly).
REGISTRY: dict[str, str] = {
    "toy.source": "actors.toy:Source",
    "toy.scale": "actors.toy:Scale",
    "toy.sink": "actors.toy:Sink",
    "proxy": "actors.proxy:ProxyActor",
}
