"""Configs: a Python file of assignments, then --key=value overrides, then validation; per stage.

    python pretrain.py configs/tiny.py --lr=3e-4 --compile=True --data=/path/to/corpus
    python sft.py --help                       # this stage's keys, with defaults and one-line comments

A stage accepts the keys it reads, no others: the model's (model.ModelConfig) and its Keys (`load(argv,
extra=...)`), assembled from the parts it reads; each concept's keys live in its file as NAME_DEFAULTS
with the check(cfg, world) of them (optim.py, muon.py, parallel.py, memory/recompute.py, ...; the
training stages' share lifecycle.TRAIN). This file is the mechanism: loading, overrides, types, the
refusal of another stage's key (naming this stage's key for the same thing: Keys' instead), --help from
every *_DEFAULTS' comments. An override is parsed as a Python literal (or JSON) and must have the default's
type (a dict key also takes a name: --rope_scaling=yarn).
The result is a flat namespace `cfg`, printed once and saved into every checkpoint; cfg.given holds the
keys the user set.

A mistake the user must fix raises UserError (or a subclass that also keeps the built-in type
callers may catch: ConfigError is a ValueError, ...): cli() prints its message once, without a
traceback.
"""
import ast
import difflib
import glob
import io
import json
import os
import sys
import time
import tokenize
import traceback
from dataclasses import asdict
from types import SimpleNamespace

import torch.distributed as dist

from model import ModelConfig


class UserError(Exception):
    """The user must fix something (a setting, a path, a file): printed once, without a traceback."""


class DataError(UserError, ValueError):
    """A problem with the data or data settings a user gave: the message says what is wrong and what to change."""


class ConfigError(UserError, ValueError):
    """A config value that cannot work."""


def need(ok, msg):
    """Raise ConfigError(msg) unless ok: a check() reads as its list of conditions and messages."""
    if not ok:
        raise ConfigError(msg)


class ConfigKeyError(UserError, KeyError):
    """An unknown config key."""

    def __str__(self):  # KeyError's str() would quote the whole message
        return str(self.args[0]) if self.args else ""


class ConfigTypeError(UserError, TypeError):
    """A config value of the wrong type."""


class MissingFileError(UserError, FileNotFoundError):
    """A file or folder the user named does not exist (or is not what it should be)."""


# a bare --key (no =value) for keys that are not bool
BARE_FLAG = {"resume": "latest"}


class Keys(dict):
    """A stage's keys beyond the model's, {key: default}, and the rules config.load applies to them.

    Keys(*parts, instead=..., replaces=...): a part is a dict of keys (a concept's NAME_DEFAULTS, or a
    selection of one), a (dict, check) pair or another Keys; a later part's default wins. Each check(cfg,
    world) runs after the model's checks, in the parts' order (validate). instead: {a key this stage does not
    read: the one line its refusal says, naming the stage's key for the same thing}. replaces: {key: keys
    it replaces}: set on the command line (not emptied), it drops those the config file set (the command line
    wins)."""

    def __init__(self, *parts, instead=None, replaces=None):
        super().__init__()
        self.checks, self.instead, self.replaces = [], {}, {}
        for part in parts:
            keys, check = part if isinstance(part, tuple) else (part, None)
            self.update(keys)
            for c in [*getattr(keys, "checks", ()), check]:
                if c and c not in self.checks:
                    self.checks.append(c)
            self.instead.update(getattr(keys, "instead", {}))
            self.replaces.update(getattr(keys, "replaces", {}))
        self.checks = tuple(self.checks)
        self.instead.update(instead or {})
        self.replaces.update(replaces or {})

    def check(self, cfg, world=1):
        """Every part's check, in order: one ConfigError at the first value that cannot work."""
        for check in self.checks:
            check(cfg, world)


class Config(SimpleNamespace):
    """The flat namespace of a run's settings; `given` (not a setting: not in vars(cfg)) holds the
    keys the config file or the command line set, `keys` the Keys it was loaded with (validate's checks)."""
    __slots__ = ("given", "keys")


def defaults(extra=None):
    """The model's keys and extra's (a stage's Keys, or a dict): Keys, with extra's checks and rules."""
    return Keys(asdict(ModelConfig()), extra or {})


def _unknown(key, d):
    if key in getattr(d, "instead", {}):  # this stage has its own key for the same thing
        return ConfigKeyError(f"unknown config key '{key}': {d.instead[key]} (--help lists this stage's keys)")
    valid = list(d)
    near = difflib.get_close_matches(key, valid, n=3, cutoff=0.5)
    hint = f" Did you mean {' or '.join(near)}?" if near else ""
    owner = key_owner(key)
    where = f" ('{key}' is a setting of {owner}, not of this stage)" if owner else ""
    return ConfigKeyError(f"unknown config key '{key}'.{where}{hint} (--help lists this stage's keys)")


def _check_type(key, value, default):
    if key == "resume" and isinstance(value, bool):  # resume=True in a file or --resume=True: the newest
        value = BARE_FLAG[key] if value else ""
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, dict):  # or a name, which its owner completes (--rope_scaling=yarn: weights.context)
        ok = isinstance(value, (dict, str))
    else:
        ok = isinstance(value, type(default))
    if not ok:
        raise ConfigTypeError(f"config key '{key}' must be {type(default).__name__} (default {default!r}), "
                              f"got {value!r} of type {type(value).__name__}")
    return value


def parse_override(arg, d):
    """'--key=value' -> (key, value): value is a Python literal (or JSON) of the default's type.
    Strings need no quotes (--data=/my/corpus); '--flag' alone means True (BARE_FLAG's value
    for the string keys it lists: bare --resume is --resume=latest)."""
    if not arg.startswith("--"):
        raise ConfigError(f"expected --key=value, got '{arg}'")
    key, eq, raw = arg[2:].partition("=")
    key = key.replace("-", "_")
    if key not in d:
        raise _unknown(key, d)
    if not eq:
        if isinstance(d[key], bool):
            return key, True
        if key in BARE_FLAG:
            return key, BARE_FLAG[key]
        raise ConfigError(f"'--{key}' needs a value: --{key}=...")
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        try:
            value = json.loads(raw)  # (JSON's true / false / null)
        except ValueError:
            value = raw  # a bare string
    if isinstance(d[key], str) and not isinstance(value, str) and not (key == "resume" and isinstance(value, bool)):
        value = raw  # a string key takes the text as written (--resume=True/False are _check_type's)
    return key, _check_type(key, value, d[key])


def read_file(path, d):
    """Execute a config file (plain Python) and keep its public assignments; it may import another's keys
    (`from configs.tiny import data`: the stage scripts' folder is on sys.path)."""
    return {key: _known(key, value, d) for key, value in _assignments(path).items()}


def _assignments(path):
    if not os.path.isfile(path):
        raise MissingFileError(f"config file '{path}' not found (configs live in configs/, e.g. configs/tiny.py)")
    scope = {}
    with open(path) as f:
        exec(compile(f.read(), path, "exec"), scope)
    return {k: v for k, v in scope.items()
            if not (k.startswith("_") or callable(v) or type(v).__name__ == "module")}


def _known(key, value, d):
    if key not in d:
        raise _unknown(key, d)
    return _check_type(key, value, d[key])


def load(argv, extra=None, world=None, script=None, example=None, plugins=None):
    """argv: [config_file.py] [--key=value ...] -> validated Config. extra: the stage's keys beyond the
    model's and their defaults (a Keys, with its checks and rules; or a plain dict). --help prints the
    stage's keys and exits; no argument at all asks for a config (example: the one to suggest) instead
    of running the defaults. plugins (a stage with model families: weights.objective_keys / variant_keys):
    plugins(values, unknown) -> (the chosen family's keys and defaults, its model check or None: the
    decoder's), from the values as read (file, then command line) and the given keys the stage lacks; its
    keys join the stage's. plugins(None, set()): every family's keys (--help lists them)."""
    d = defaults(extra)
    args = list(argv)
    name = os.path.basename(script or sys.argv[0] or "the script")
    if "--help" in args or "-h" in args:
        print(help_text(Keys(d, plugins(None, set())[0]) if plugins else d, name))
        raise SystemExit(0)
    if not args and example:
        raise UserError(f"no config: give one, e.g. `python {name} {example}`, or --key=value settings to run the "
                        f"defaults (a {d['n_layer']}-layer, {d['n_embd']}-wide model); --help lists the keys")
    file = _assignments(args.pop(0)) if args and not args[0].startswith("--") else {}
    model = None
    if plugins:  # the family the values choose: its keys (and their defaults) join the stage's
        read = dict(file)
        for a in args:
            key = a[2:].partition("=")[0].replace("-", "_")
            read[key] = parse_override(a, d)[1] if key in d else None
        more, model = plugins({**d, **read}, set(read) - set(d))
        d = Keys(d, more)
    from_file = {k: _known(k, v, d) for k, v in file.items()}
    values, given = dict(d), set(from_file)
    values.update(from_file)
    on_line = dict(parse_override(a, d) for a in args)
    values.update(on_line)
    given |= set(on_line)
    for k in [k for k, v in on_line.items() if v]:  # the command line wins: set there, a key drops the file's
        for r in set(d.replaces.get(k, ())) & set(from_file) - set(on_line):  # keys for the same thing
            values[r] = d[r]
            given.discard(r)
    cfg = Config(**values)
    cfg.given, cfg.keys = given, d
    validate(cfg, int(os.environ.get("WORLD_SIZE", "1")) if world is None else world, model)
    return cfg


def validate(cfg, world=1, model=None, *, keys=None):
    """The model's keys, then the checks of keys (default: the Keys cfg was loaded with; a bare namespace
    has none): fail early, with a message that says what to change. model(cfg): the model config's checks
    (default ModelConfig's; another family's: weights.Family.model_config). Stages check their own keys too
    (their check()); call this again after cfg's model keys change."""
    try:
        (model or ModelConfig.from_cfg)(cfg)  # model checks (heads divide width, known activation, ...)
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from e
    (keys or getattr(cfg, "keys", None) or Keys()).check(cfg, world)


def show(cfg):
    width = max(len(k) for k in vars(cfg))
    return "\n".join(f"  {k:<{width}} = {v!r}" for k, v in sorted(vars(cfg).items()))


# ----------------------------------------------------------------------------- --help, from the source's comments

def _comments(path):
    """{key: its one-line comment} of a source file: the keywords of every `NAME_DEFAULTS = dict(...)`
    and the fields of ModelConfig, with the comment on their line (and comment-only lines that
    continue it)."""
    src = open(path, encoding="utf-8").read()
    if "DEFAULTS = dict(" not in src and "class ModelConfig" not in src:  # (most files: nothing to parse)
        return {}
    lines, keys, spans = src.splitlines(), [], []
    for node in ast.walk(ast.parse(src)):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id.endswith("DEFAULTS") and isinstance(node.value, ast.Call)):
            spans.append(node)
            keys += [(kw.arg, kw.value.lineno, kw.value.end_lineno) for kw in node.value.keywords if kw.arg]
        elif isinstance(node, ast.ClassDef) and node.name == "ModelConfig":
            spans.append(node)
            keys += [(item.target.id, item.lineno, item.end_lineno) for item in node.body
                     if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)]
    notes = {}  # line -> its comment, of those spans only (tokenizing whole files is slow)
    for node in spans:
        text = "\n".join(lines[node.lineno - 1:node.end_lineno])
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                notes[node.lineno - 1 + tok.start[0]] = tok.string.lstrip("#").strip()
    out = {}
    for key, line, end in keys:
        text = [notes[line]] if line in notes else []
        nxt = end + 1  # comment-only lines right below, indented past the key: a continuation
        while nxt in notes and lines[nxt - 1].lstrip().startswith("#") and len(lines[nxt - 1]) - len(
                lines[nxt - 1].lstrip()) > len(lines[line - 1]) - len(lines[line - 1].lstrip()):
            text.append(notes[nxt])
            nxt += 1
        out.setdefault(key, " ".join(text))
    return out


NOT_WINGS = ("tests", "configs", "bench", "docker", "runs", "docs")  # folders whose .py files hold no keys
HERE = os.path.dirname(os.path.abspath(__file__))


def _sources(script=None):
    """The root's and the wings' .py files, the script's own first (a path, or a name of the root's)."""
    files = sorted(glob.glob(os.path.join(HERE, "*.py")) + glob.glob(os.path.join(HERE, "*", "*.py")))
    files = [f for f in files if os.path.basename(os.path.dirname(f)) not in NOT_WINGS]
    first = [p for p in ([os.path.abspath(script), os.path.join(HERE, os.path.basename(script))] if script else [])
             if os.path.isfile(p)][:1]
    return first + [f for f in files if f not in first]


def key_owner(key, script=None):
    """The file(s) whose *_DEFAULTS define `key` (for the message of a key this stage lacks), or ""."""
    here = os.path.abspath(script) if script else None
    owners = [os.path.basename(f) for f in _sources() if f != here and key in _comments(f)]
    return ", ".join(owners)


def help_text(d, script):
    """Every key of a stage with its default and one-line comment, grouped: the stage's own (and those no
    file defines), the others by the file that defines them (in the order the stage took them), the model's."""
    notes, owner = {}, {}
    for path in _sources(script):
        for k, v in _comments(path).items():
            notes.setdefault(k, v)
            owner.setdefault(k, os.path.relpath(path, HERE))
    mine, own = os.path.basename(script), f"{script}'s own keys"
    model = "model keys (model.ModelConfig; from init_from when it is set)"
    groups = {own: []}
    for k in d:  # the model's keys, then the stage's parts in the order it took them
        where = owner.get(k, mine)
        groups.setdefault(own if where == mine else model if where == "model.py" else where, []).append(k)
    groups[model] = groups.pop(model, [])
    out = [f"usage: python {script} [config.py] [--key=value ...]   (torchrun --nproc_per_node=N {script} ... "
           "for several processes)", "A config file is Python assignments of these keys; --key=value overrides it."]
    shared = [title for title in groups if title not in (own, model)]
    for title, keys in [(t, k) for t, k in groups.items() if k]:
        if shared and title == shared[0]:
            out.append("\nshared keys (other stages read them too), by the file that defines them:")
        out.append(f"  {title}:" if title in shared else f"\n{title}:")
        indent, width = " " * (4 if title in shared else 2), max(len(f"{k}={d[k]!r}") for k in keys)
        out += [f"{indent}{f'{k}={d[k]!r}':<{width}}  {notes.get(k, '')}".rstrip() for k in keys]
    return "\n".join(out)


# ----------------------------------------------------------------------------- the command line

def cli(main, argv):
    """Run a stage script's main(argv) so that a mistake the user must fix reads as one message.

    A UserError prints `error: <message>` once and exits with status 2, without a traceback: rank 0
    under torchrun (every rank meets the same error; the others leave quietly with status 0, so
    torchrun's own summary that follows names one failed process, and its error file carries the
    same line); `--debug` anywhere on the command line shows the traceback instead. Every other
    exception is a bug and keeps its traceback on every rank that hits it. The process group, if
    any, is destroyed on the way out.
    """
    debug = "--debug" in argv
    try:
        return main([a for a in argv if a != "--debug"])
    except UserError as e:
        if debug:
            raise
        if os.environ.get("RANK", "0") != "0":
            sys.exit(0)  # rank 0 reports it: torchrun's summary then names one failed process, not all
        print(f"error: {e}", file=sys.stderr, flush=True)
        if os.environ.get("TORCHELASTIC_ERROR_FILE"):  # torchrun's summary shows this instead of "no traceback"
            with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
                json.dump({"message": {"message": f"error: {e}", "extraInfo": {
                    "py_callstack": f"error: {e}", "timestamp": str(int(time.time()))}}}, f)
        sys.exit(2)
    except KeyboardInterrupt:  # a second Ctrl-C (the first one saves: lifecycle.Interrupt)
        if debug:
            traceback.print_exc()
        sys.exit(130)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
