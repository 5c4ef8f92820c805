"""The house's rules, checked over the source: a task type is spelled in one place (its contract), a setting's
default is declared in one place (config.py's SETTINGS), the floors import downwards, and the modules the
architecture names are where it says."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from nodeagent.config import SETTINGS, SETTINGS_BY_NAME, default_of
from nodeagent.tasks import registry
from nodeagent.tasks.contracts import CONTRACTS, TYPE_NAMES

PACKAGE = Path(__file__).resolve().parent.parent / "nodeagent"
# the names a setting goes by in the configs built from it (fleet/worker.py, fleet/guard.py, server/served.py)
ALIASES = {"guard_memory_pct": "memory_pct", "guard_cpu_pct": "cpu_pct", "guard_error_rate": "error_rate",
           "alert_webhook": "webhook", "server_queue": "queue_size", "result_retention_s": "retention_s",
           "task_timeout_s": "default_timeout_s", "guard_temp_c": "temp_c", "guard_cool_c": "cool_c",
           "guard_heat_pause_s": "heat_pause_s", "guard_thermal_pressure": "thermal_pressure",
           "guard_psi_some_pct": "psi_some_pct", "guard_psi_full_pct": "psi_full_pct"}


def modules() -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text(), str(p))) for p in sorted(PACKAGE.rglob("*.py"))]


def literal(node: ast.AST | None) -> object:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
        return -node.operand.value
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Field" and node.args:
        return literal(node.args[0])  # Field(60.0, ...)
    return ...


def docstrings(tree: ast.Module) -> set[int]:
    """The ids of the string constants that are docstrings or descriptions: prose may name a task type."""
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            out.add(id(body[0].value))
        if isinstance(node, ast.keyword) and node.arg in ("description", "help", "hint"):
            out.update(id(n) for n in ast.walk(node.value) if isinstance(n, ast.Constant))
    return out


def test_every_contract_has_one_registry_entry_and_its_type_is_its_name():
    assert [t.contract for t in registry.TYPES] == list(CONTRACTS)
    assert registry.names() == list(TYPE_NAMES)
    for spec in registry.TYPES:
        assert registry.get(spec.name.rsplit(".", 1)[0]) is spec and registry.get(spec.name) is spec


def test_task_type_names_are_spelled_only_in_their_contracts():
    names = set(registry.names())
    found = []
    for path, tree in modules():
        if path.name == "contracts.py" and path.parent.name == "tasks":
            continue
        prose = docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
                if node.value in names or any(f"{n}" in node.value and node.value.startswith(n) for n in names):
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {node.value!r}")
    assert not found, "task type names written outside their contract:\n" + "\n".join(found)


def test_setting_defaults_are_declared_only_in_config():
    """Anywhere: a setting's default value written again under its name (or the name a config gives it). In a
    config class built from the settings (WorkerConfig, GuardConfig, ServerConfig, ...): any literal default
    for a setting at all, equal or not (WorkerConfig's max_attempts once said 100 where the setting said 4)."""
    defaults = {s.name: default_of(s.name) for s in SETTINGS}
    names = {**{n: n for n in defaults}, **{alias: name for name, alias in ALIASES.items()}}
    found = []
    for path, tree in modules():
        if path.name == "config.py" and path.parent == PACKAGE:
            continue
        where = path.relative_to(PACKAGE.parent)
        configs = {id(n) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name.endswith("Config")
                   for n in c.body}
        for node in ast.walk(tree):
            pairs: list[tuple[str, ast.AST | None, int]] = []
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                pairs.append((node.target.id, node.value, node.lineno))
            elif isinstance(node, ast.Assign):
                pairs += [(t.id, node.value, node.lineno) for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.args + node.args.kwonlyargs
                given = [None] * (len(node.args.args) - len(node.args.defaults)) + node.args.defaults + \
                    node.args.kw_defaults
                pairs += [(a.arg, d, node.lineno) for a, d in zip(args, given)]
            for name, value, line in pairs:
                setting = names.get(name) or names.get(name.lower())
                if setting is None and name.isupper():  # a module constant named after a setting
                    setting = next((n for n in names if n.upper() in name), None)
                if setting is None or defaults[setting] is None or isinstance(defaults[setting], Path):
                    continue  # (a setting left to the planner has no default: the value is the plan's)
                written = literal(value)
                if written is ... or written is None:
                    continue
                if written == defaults[setting] or id(node) in configs:
                    found.append(f"{where}:{line}: {name} = {written!r} (the setting {setting}'s default is "
                                 f"{defaults[setting]!r}, declared in config.py)")
    assert not found, "setting defaults written outside config.py:\n" + "\n".join(found)


def test_every_setting_resolves_from_its_default():
    module = __import__("nodeagent.config", fromlist=["resolve"])
    config = module.resolve(env={})
    for s in module.SETTINGS:  # (as the tests run them: conftest gives each test its own prefix directory)
        assert config.source(s.name) == "default"
        assert getattr(config, s.name) == s.default({})
    assert set(type(config).model_fields) - {"sources"} == set(SETTINGS_BY_NAME)


BASE_MODULES = ("clock.py", "codes.py", "config.py", "datafiles.py", "errors.py", "hostload.py", "kv_types.py",
                "ledger.py", "model_kinds.py", "model_names.py", "output.py", "payload.py", "private.py", "procmem.py", "tomlfile.py",
                "units.py", "urls.py", "values.py")


def test_the_floors_import_downwards():
    """The planner imports no backend, tasks never import the node core, backends import no tasks (a prompt is
    rendered by the caller), the fleet imports neither the server nor the page, the page no server, and nothing
    below the CLI imports it; the broker's engines import only its protocol, and the protocol no engine. The
    top-level base modules import no package, and the node core nothing above it."""
    rules = {"planner": ("nodeagent.backends", "nodeagent.node", "nodeagent.cli", "nodeagent.fleet",
                         "nodeagent.server"),
             "tasks": ("nodeagent.node", "nodeagent.cli", "nodeagent.fleet", "nodeagent.server"),
             "backends": ("nodeagent.node", "nodeagent.cli", "nodeagent.fleet", "nodeagent.server", "nodeagent.tasks"),
             "fleet": ("nodeagent.server", "nodeagent.ui"),
             "ui": ("nodeagent.server",),
             "broker": ("nodeagent.node", "nodeagent.cli", "nodeagent.fleet", "nodeagent.server",
                        "nodeagent.backends")}
    # the top-level modules have floors too: the base ones (errors, settings, values, URLs, codes...) import no
    # package; the node core and its model set nothing above them; profiles only the probe's types
    packages = sorted(f"nodeagent.{p.name}" for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    above_the_node = ("nodeagent.fleet", "nodeagent.server", "nodeagent.ui", "nodeagent.cli", "nodeagent.broker")
    top = {**{name: tuple(packages) for name in BASE_MODULES},
           "profiles.py": tuple(p for p in packages if p != "nodeagent.hardware"),
           "node.py": above_the_node, "modelset.py": above_the_node,
           # the measured route of classification: under the model set and the gateway that use it, over the tasks
           "classify_routes.py": (*above_the_node, "nodeagent.backends", "nodeagent.planner")}
    on_top = {p.name for p in PACKAGE.glob("*.py")} - {"__init__.py", "__main__.py", "client.py"}
    assert on_top == set(top), f"a top-level module with no floor: {sorted(on_top ^ set(top))}"
    found = []
    for path, tree in modules():
        rel = path.relative_to(PACKAGE)
        floor = rel.parts[0] if len(rel.parts) > 1 else None
        imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module] + \
            [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        for module in imported:
            if floor is None and rel.name in top and module.startswith(top[rel.name]):
                found.append(f"{rel} imports {module}")
            if floor != "cli" and rel.name != "__main__.py" and module.startswith("nodeagent.cli"):
                found.append(f"{rel} imports {module}")
            if floor in rules and module.startswith(rules[floor]):
                found.append(f"{rel} imports {module}")
            if rel.as_posix() == "broker/base.py" and module.startswith(("nodeagent.broker.sqlite",
                                                                          "nodeagent.broker.redis")):
                found.append(f"{rel} imports {module}")
    assert not found, "\n".join(found)


def test_when_a_node_is_lost_is_written_once():
    """One liveness rule (``NodeRecord.heard``, ``lost_after``): its constant assigned in one place, and no other
    module multiplies a heartbeat interval by that number of beats itself."""
    from nodeagent.broker.base import LOST_AFTER_BEATS

    defined, multiplied = [], []
    for path, tree in modules():
        rel = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, ast.AnnAssign) else []
            defined += [rel for t in targets if isinstance(t, ast.Name) and "BEATS" in t.id and "STALE" not in t.id]
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
                sides = [ast.unparse(node.left), ast.unparse(node.right)]
                if any("heartbeat_s" in x for x in sides) and LOST_AFTER_BEATS in (literal(node.left),
                                                                                   literal(node.right)):
                    multiplied.append(f"{rel}: {ast.unparse(node)}")
    assert defined == ["broker/base.py"], defined
    assert not multiplied, multiplied


def test_no_function_is_over_120_lines():
    """A function that long holds several concerns: its state wants to be an object, its phases methods."""
    long = [f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path, tree in modules() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 120]
    assert not long, "\n".join(long)


def test_no_function_in_tasks_takes_more_than_10_parameters():
    """A decode's or a request's options travel as one value (``DecodeSpec``, ``CompletionSpec``), not threaded
    through signatures by hand (``decode`` once took 17)."""
    wide = [f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({n} parameters)"
            for path, tree in modules() if path.relative_to(PACKAGE).parts[0] == "tasks"
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            for n in [len([a for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                           if a.arg not in ("self", "cls")])] if n > 10]
    assert not wide, "\n".join(wide)


def test_one_field_table():
    """Every OpenAI request's fields are treated in tasks/openai/fields.py (one ``FieldTable`` type, its rows): no
    other module holds a row (a field mapped to honoured, ignored or refused) or builds a table."""
    treatments = {"honoured", "ignored", "refused"}
    found = []
    for path, tree in modules():
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "tasks/openai/fields.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Dict) and any(literal(v) in treatments for v in node.values):
                found.append(f"{rel}:{node.lineno}: a table's rows")
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name in ("FieldTable", "check_fields"):
                found.append(f"{rel}:{node.lineno}: {node.name}")
            if isinstance(node, ast.Call) and "FieldTable" in ast.unparse(node.func):
                found.append(f"{rel}:{node.lineno}: a FieldTable built")
    assert not found, "\n".join(found)


def test_one_stream_driver():
    """A completion's events are folded into a stream in one place (server/events.py's ``stream``, over a
    ``Renderer``): no other function walks Pieces to their Finished or Failed."""
    drivers = []
    for path, tree in modules():
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            checked = {ast.unparse(c.args[1]).split(".")[-1] for c in ast.walk(node) if isinstance(c, ast.Call)
                       and getattr(c.func, "id", None) == "isinstance" and len(c.args) == 2}
            if {"Piece", "Finished", "Failed"} <= checked:
                drivers.append(f"{path.relative_to(PACKAGE).as_posix()}:{node.name}")
    assert drivers == ["server/events.py:stream"], drivers


def test_a_slot_s_context_is_derived_in_one_place():
    """``planner/types.ctx_per_slot`` is the one division of the context by the slots; the rest call it."""
    divisions = [f"{path.relative_to(PACKAGE)}: {ast.unparse(node)}" for path, tree in modules()
                 for node in ast.walk(tree) if isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv)
                 and "slots" in ast.unparse(node.right) and "ctx" in ast.unparse(node.left)]
    assert divisions == ["planner/types.py: n_ctx // slots"], divisions


def test_both_answer_followers_are_closers():
    """The budget types its follower as ``Closer``: the JSON one and the tool-call one both declare it in full."""
    from nodeagent.tasks.decoding.closer import Closer, JsonCloser
    from nodeagent.tasks.decoding.instances import Schemas
    from nodeagent.tasks.openai.tools import HermesCloser

    call = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    for closer in (JsonCloser(call), HermesCloser(call, calls_only=False, cap=2, schemas=Schemas(call))):
        assert isinstance(closer, Closer)
        closer.feed(b"{" if isinstance(closer, JsonCloser) else b"hi")
        assert isinstance(closer.copy(), Closer) and closer.closing() is not None and closer.path()


def test_an_answer_has_one_json_follower():
    """The guards, the budget and the drafts read one follower per answer, fed once per token."""
    import llguidance

    from nodeagent.backends.fake import FakeSession, FakeSpec
    from nodeagent.tasks.decoding.decoder import Decoder, DecodeSpec
    from nodeagent.tasks.openai import tools

    session = FakeSession(FakeSpec(), 4096)
    plan = tools.plan_tools([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}], "required", False, None, 100, 10)
    matcher = llguidance.LLMatcher(session.lltokenizer(), tools.grammar(plan))
    d = Decoder(session, [], matcher, DecodeSpec(64, closing=tools.closers(plan), fast_forward=True, draft_tokens=4))
    assert d.guards.reading is d.reading and d.budget is not None and d.budget.reading is d.reading
    fed = []
    d.reading.closer.feed = fed.append  # type: ignore[method-assign]
    d.append(session.tokenize_continuation("{")[0], "chosen")
    assert fed == [b"{"]
    source = (PACKAGE / "tasks/decoding/guards.py").read_text()
    assert ".feed(" not in source and "class Json" not in source  # the guards keep no reading of their own


def test_the_layout_is_the_architectures():
    for part in ("fleet/worker.py", "fleet/registration.py", "fleet/guard.py", "fleet/status.py", "fleet/client.py",
                 "fleet/responses.py", "broker/open.py", "tasks/registry.py", "tasks/templates.py",
                 "tasks/openai/fields.py", "tasks/openai/requests.py", "tasks/openai/responses.py",
                 "tasks/openai/spec.py", "tasks/openai/engine.py", "tasks/openai/bodies.py", "tasks/openai/tools.py",
                 "server/openai_routes.py", "server/typed_routes.py", "server/ops_routes.py", "server/middleware.py",
                 "planner/fake.py", "server/executors/local.py", "server/executors/fleet.py", "server/runtime.py",
                 "codes.py", "urls.py"):
        assert (PACKAGE / part).is_file(), part
    assert sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("base.py")) == \
        ["backends/base.py", "broker/base.py"]
    assert sorted(p.name for p in (PACKAGE / "broker" / "lua").glob("*.lua"))


def import_graph() -> dict[str, set[str]]:
    """Each module of the package and the package modules it imports, at any depth of its code (an import inside a
    function is an arrow all the same): ``from nodeagent.tasks import registry`` is an arrow to
    ``nodeagent.tasks.registry``."""
    names = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
             for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        edges = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nodeagent"):
                subs = {f"{node.module}.{a.name}" for a in node.names} & set(names)
                edges.update(subs or ({node.module} & set(names)))
        edges.discard(name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    """Arrows point down the data path: no module reaches back up to one that (through others) imports it."""
    found = circles(import_graph())
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_every_package_ships_in_the_wheel():
    """pyproject.toml lists the packages explicitly (profiles/ and models/ ship under other names): a folder of
    the package that is not listed would be missing from every installed node."""
    import tomllib

    listed = set(tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join(p.relative_to(PACKAGE.parent).parts) for p in PACKAGE.rglob("*")
               if p.is_dir() and p.name != "__pycache__" and (any(p.glob("*.py")) or any(p.glob("*.lua")))}
    assert folders - listed == set(), f"not in pyproject.toml's packages: {sorted(folders - listed)}"


def test_a_models_kind_is_asked_by_capability_and_a_task_reaches_its_code_by_its_hook():
    """A model's kind has one home (``model_kinds.py``: derived once from the header, asked as ``kind.generates``,
    ``kind.embeds``, ``kind.ranks``): no other module writes its word "generate", nor compares a ``kind`` with a
    string ("embed" and "rerank" are also task types' roles: the planner's tasks, the CLI's commands). A task reaches
    the code that runs it through its type's hook (``registry``): nothing in tasks/ calls what ``getattr`` looked up
    by name."""
    words = {"generate"}
    found = []
    for path, tree in modules():
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "model_kinds.py":
            continue
        prose = docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in words and id(node) not in prose:
                found.append(f"{rel}:{node.lineno}: the kind {node.value!r} written out")
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(isinstance(x, ast.Attribute) and x.attr == "kind" for x in sides) and any(
                        isinstance(x, ast.Constant) and x.value in {*words, "embed", "rerank"} for x in sides):
                    found.append(f"{rel}:{node.lineno}: a kind compared with a string")
            if rel.startswith("tasks/") and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                looked_up = {t.id for n in ast.walk(node) if isinstance(n, ast.Assign) and _getattr(n.value)
                             for t in n.targets if isinstance(t, ast.Name)}
                for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
                    if _getattr(call.func) or (isinstance(call.func, ast.Name) and call.func.id in looked_up):
                        found.append(f"{rel}:{call.lineno}: a call dispatched by a name looked up with getattr")
    assert not found, "\n".join(found)


def _getattr(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"


def test_every_task_type_declares_its_hook_its_kinds_and_what_each_kind_leaves_unread():
    """Each task type's hook is a public method of ``Runner`` that refuses by default, naming the kind; each kind
    that runs the type has a runner that overrides it; a field a kind leaves unread is a field of the contract."""
    from nodeagent.model_kinds import ModelKind
    from nodeagent.tasks.embedding import EmbedRunner, RerankRunner
    from nodeagent.tasks.runner import Runner, TaskRunner

    runners = {ModelKind.GENERATE: TaskRunner, ModelKind.EMBED: EmbedRunner, ModelKind.RERANK: RerankRunner}
    assert set(runners) == set(ModelKind)
    hooks = {"extract", "classify", "complete", "embed", "rerank"}
    assert hooks <= set(vars(Runner)) and not any(name.startswith("_") for name in hooks)
    from types import SimpleNamespace

    from nodeagent.errors import TaskFailed

    for spec in registry.TYPES:
        assert spec.kinds and set(spec.unread) <= spec.kinds, spec.name
        with pytest.raises(TaskFailed) as refused:  # the hook is a method of every runner: the base refuses it
            spec.hook(Runner(), SimpleNamespace(type=spec.name), [], {}, {})
        assert refused.value.code == "wrong_model_kind", spec.name
        for kind in spec.kinds:
            overridden = {n for n in hooks if vars(runners[kind]).get(n) is not None}
            assert overridden, (spec.name, kind)
            for field in spec.unread.get(kind, {}):
                assert field in spec.contract.model_fields, (spec.name, field)


ENGINE_FILE_MOST_LINES = 450  # the engines were one file each of some 800 lines; the largest store (tasks) is ~420


def test_the_broker_s_engines_keep_one_file_per_store():
    """Each of the broker's stores (``broker/base.py``'s protocols: tasks, logs, nodes, history, events, documents,
    key-values) has a retention hook that ``purge`` runs, and is implemented by both engines, every method of it in
    one file of the engine's package that holds no other store's. No file of an engine grows past
    ENGINE_FILE_MOST_LINES, and an engine's files import no other engine."""
    from nodeagent.broker.base import STORES, Broker, purge_stores
    from nodeagent.broker.redis import RedisBroker
    from nodeagent.broker.sqlite import SqliteBroker

    assert STORES and set(STORES) == {b for b in Broker.__bases__ if b.__name__ != "Protocol"}  # Broker: the stores
    hooks = []
    for store in STORES:
        found = [n for n in vars(store) if n.startswith("purge_")]
        assert len(found) == 1, f"{store.__name__} needs one retention hook (purge_<concern>): {found}"
        hooks += found

    class Recorder:
        def __init__(self) -> None:
            self.called: list[str] = []

        def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
            return lambda older_than_s: self.called.append(name) or 0

    recorder = Recorder()
    purge_stores(recorder, 60.0)  # type: ignore[arg-type]
    assert sorted(recorder.called) == sorted(hooks), "purge must run every store's retention"
    for engine in (RedisBroker, SqliteBroker):
        package = engine.__module__
        homes: dict[str, str] = {}
        for store in STORES:
            methods = [n for n, v in vars(store).items() if callable(v) and not n.startswith("_")]
            missing = [n for n in methods if not callable(getattr(engine, n, None))]
            assert not missing, f"{engine.__name__} lacks {store.__name__}'s {missing}"
            where = {getattr(engine, n).__module__ for n in methods}
            assert len(where) == 1, f"{engine.__name__}'s {store.__name__} is spread over {sorted(where)}"
            home = where.pop()
            assert home.startswith(package + ".") and home.rsplit(".", 1)[1] != "connection", (engine, store, home)
            assert home not in homes.values(), f"{home} holds {store.__name__} and {homes}"
            homes[store.__name__] = home
    for name in ("redis", "sqlite"):
        other = "nodeagent.broker." + ("sqlite" if name == "redis" else "redis")
        for path in sorted((PACKAGE / "broker" / name).glob("*.py")):
            lines = len(path.read_text().splitlines())
            assert lines <= ENGINE_FILE_MOST_LINES, f"{path.relative_to(PACKAGE)}: {lines} lines"
            tree = ast.parse(path.read_text(), str(path))
            imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module] + \
                [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
            assert not [m for m in imported if m.startswith(other)], f"{path.relative_to(PACKAGE)} imports {other}"


def test_one_purge():
    """What expiry leaves is purged in one place, ``broker/base.py``'s ``Purge`` (at most once a PURGE_EVERY_S,
    reading the retention under its setting's name), which the gateway runs on ``runtime.every`` and a worker (no
    app) calls from its heartbeat loop: no other module calls ``Broker.purge`` or times a purge of its own."""
    from nodeagent.broker.base import PURGE_EVERY_S, Purge

    calls, timed, made, run_every = [], [], [], []
    for path, tree in modules():
        rel = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "purge" \
                    and not rel.startswith("broker/"):
                calls.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
            if isinstance(node, ast.Name) and node.id == "PURGE_EVERY_S" and rel != "broker/base.py":
                timed.append(rel)
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Purge":
                made.append(rel)
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "every" and \
                    any(getattr(getattr(a, "func", None), "id", None) == "Purge" for a in node.args):
                run_every.append((rel, ast.unparse(node.args[1])))
    assert not calls, calls
    assert sorted(made) == ["fleet/worker.py", "server/app.py"], made
    assert run_every == [("server/app.py", "PURGE_EVERY_S")] and set(timed) == {"server/app.py"}, (run_every, timed)

    class Counting:
        purged: list[float] = []

        def purge(self, older_than_s: float) -> int:
            self.purged.append(older_than_s)
            return 0

    now = [100.0]
    broker = Counting()
    purge = Purge(broker, 7.0, clock=lambda: now[0])  # type: ignore[arg-type]
    assert purge() == 0 and purge() is None  # the first call purges; the next within PURGE_EVERY_S does not
    now[0] += PURGE_EVERY_S
    assert purge() == 0 and broker.purged == [7.0, 7.0]


def test_a_node_s_liveness_is_one_function():
    """``NodeRecord.liveness`` (over ``heard``) is the one answer to "is this node live", which the fleet's read
    model, the gateway's directory and the scheduler ask: no other module calls ``heard`` or spells the states in
    which a node is given work (``SERVING_STATES``)."""
    from nodeagent.broker.base import SERVING_STATES

    found = []
    for path, tree in modules():
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "broker/base.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "heard":
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and \
                    len({literal(e) for e in node.elts} & set(SERVING_STATES)) >= 2:
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "\n".join(found)
    asked = {rel for path, tree in modules() for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and node.attr == "liveness"
             for rel in [path.relative_to(PACKAGE).as_posix()]}
    assert {"fleet/status.py", "server/executors/fleet.py", "fleet/scheduler.py"} <= asked, asked


def test_refused_is_never_translated_by_hand():
    """``Refused`` (a request's checks) is an HttpError the middleware renders, and a ValueError for a library
    caller: no handler of it builds an HttpError, and only the Batch API's ``create`` handles it (into its own
    error, the CLI's too). A ValidationError's location is read in ``errors.py`` alone (``param_of``)."""
    from nodeagent.errors import HttpError
    from nodeagent.tasks.openai.fields import Refused

    assert issubclass(Refused, HttpError) and issubclass(Refused, ValueError)
    handlers, by_hand, loc = [], [], []
    for path, tree in modules():
        rel = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(tree):
            if isinstance(node, ast.ExceptHandler) and node.type is not None and \
                    "Refused" in {getattr(n, "id", None) for n in ast.walk(node.type)}:
                handlers.append(rel)
                by_hand += [f"{rel}:{c.lineno}" for c in ast.walk(node) if isinstance(c, ast.Call)
                            and "HttpError" in ast.unparse(c.func)]
            if isinstance(node, ast.Constant) and node.value == "loc" and rel != "errors.py":
                loc.append(f"{rel}:{node.lineno}")
    assert not by_hand, by_hand
    assert handlers == ["fleet/batches.py"], handlers
    assert not loc, loc


def test_no_two_classes_share_a_name():
    """A class's name says which it is: two classes of one name in the package (a decoder's Budget and the
    planner's, a following node's Follower and a log's) are one rename away from a wrong import."""
    where: dict[str, list[str]] = {}
    for path, tree in modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(f"{path.relative_to(PACKAGE).as_posix()}:{node.lineno}")
    shared = {name: places for name, places in where.items() if len(places) > 1}
    assert not shared, shared
