"""Experiment configs (docs/DESIGN.md §4): reading one, checking it against the engine's flag table,
and turning it into the engine's command line. Shared by the proxy, the benchmark and the tools.

The engine owns the list of keys: every config key `section.key` is the engine flag --section.key,
and `ENGINE --flags-json` publishes the flags (type, default, choices, range, required). Flags
without a dot (--checkpoint, --resume, ...) are the command line's own, not config keys. The proxy
adds a few keys that are its own (OWN_KEYS).

A list of objects (`data.sources`) is published as one flag per field of its items,
`data.sources.N.train` with `"items": n` (at most n items): item i's field becomes
--data.sources.i.train, and errors name it `data.sources[i].train`. A flag with `"one_of"` names
keys of which a config gives exactly one (`data.train` or `data.sources`)."""
import json
import math
import os
import re

from microgpt.engines import ROOT
from microgpt.files import DuplicateKeyError, JsonTooDeep, has_lone_surrogate, loads_json, open_regular

OWN_KEYS = {  # key: (type, required)
    "name": ("str", True),          # names the run directory and files; passed as --name
    "description": ("str", False),  # free text for people; not passed to the engine
    "sample.prompts": ("prompts", False),  # strings, tokenized into repeated --sample.prompt ids
}
# Limits that keep a config something a person wrote: the run's name is part of file names (of at
# most 255 bytes, the longest <name>.ckpt.prev.json.tmpPID; so it is counted in bytes), the state
# file (rewritten twice a second) carries the config, and the prompts travel on the engine's
# command line, where Linux allows one argument at most 128 KiB.
NAME_MAX_BYTES = 100
DESCRIPTION_MAX_CHARS = 10_000
PROMPTS_MAX_CHARS = 65_536  # all prompts together
ARG_MAX_BYTES = 128 * 1024
# A config is read whole before it is parsed: a longer file is refused unread, where a shard or a disk
# image given by mistake took all memory. Far above any config the limits above allow (its prompts
# written as \u escapes, 32 data sources with the longest paths the engine takes).
CONFIG_MAX_BYTES = 4 << 20
TYPE_WORDS = {"int": "an integer", "float": "a number", "str": "a non-empty string", "path": "a path",
              "glob": "a glob pattern", "bool": "true or false", "prompts": "a list of strings",
              "list": "a list of objects"}
ITEM_INDEX = re.compile(r"\.(N|\d+)\.")  # the item index of a list-item flag: data.sources.N.train
# A data source's name, as the engine takes it (config.h's config_validate_sources: ASCII letters and
# digits, ".", "_", "-"), and each name once
SOURCE_NAME = re.compile(r"[A-Za-z0-9._-]+")


class ConfigError(ValueError):
    pass


class FloatUnderflow(ValueError):
    pass


def float_that_is_not_lost(text):
    """float(text), where a number that is not 0 must not become 0.0 (1e-400 does, silently: a
    grad_clip of 1e-400 would switch clipping off, 0's meaning)."""
    x = float(text)
    if x == 0.0 and any(c in "123456789" for c in text.lower().split("e")[0]):
        raise FloatUnderflow(f"{text} is too small for a float, which would hold it as 0")
    return x


def read_config(path):
    """The JSON document at path (any JSON: validate_config says whether it is a config)."""
    try:
        with open(open_regular(path), "rb") as f:
            data = f.read(CONFIG_MAX_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"cannot read it: {e.strerror}") from None
    if len(data) > CONFIG_MAX_BYTES:
        raise ConfigError(f"it is longer than {CONFIG_MAX_BYTES} bytes, more than any config")
    try:  # JSON's encoding, whatever the locale's (a UnicodeDecodeError is a ValueError: not valid JSON)
        return loads_json(data.decode("utf-8"), parse_float=float_that_is_not_lost)
    except FloatUnderflow as e:
        raise ConfigError(str(e)) from None
    except DuplicateKeyError as e:
        raise ConfigError(f"{e}; which one is meant is ambiguous (give it once)") from None
    except JsonTooDeep:
        raise ConfigError("nested too deeply to be a config (a config is sections of keys)") from None
    except ValueError as e:
        raise ConfigError(f"not valid JSON: {e}") from None


def load_config(path, flags):
    """A config checked against the engine's flag table."""
    cfg = read_config(path)
    validate_config(cfg, flags)
    return cfg


def list_fields(flags):
    """{list key: {field: flag}} from the list-item flags ("data.sources.N.train" -> "data.sources")."""
    lists = {}
    for name, f in flags.items():
        if f.get("items"):
            key, _, field = name.partition(".N.")
            lists.setdefault(key, {})[field] = f
    return lists


def item_flag(name, flags):
    """The table entry of a flag given with an item index ("data.sources.3.train"), or of a plain one."""
    return flags.get(name) or flags.get(ITEM_INDEX.sub(".N.", name, count=1))


def config_keys(flags):
    """The keys a config may hold -> what each must be: the engine's dotted flags (but the
    token-id prompts, which the proxy makes from sample.prompts, and the list-item flags, which
    make list keys), the list keys and the proxy's own keys."""
    keys = {name: f["type"] for name, f in flags.items()
            if "." in name and f["type"] != "prompt" and not f.get("items")}
    keys.update({key: "list" for key in list_fields(flags)})
    keys.update({key: kind for key, (kind, _) in OWN_KEYS.items()})
    return keys


def _type_ok(kind, value):
    if kind == "bool":
        return isinstance(value, bool)
    if isinstance(value, bool):  # JSON true/false are ints to Python; never a number here
        return False
    if kind == "int":
        return isinstance(value, int)
    if kind == "float":
        return isinstance(value, (int, float))
    if kind == "prompts":
        return isinstance(value, list) and all(isinstance(p, str) and p for p in value)
    if kind == "list":
        return isinstance(value, list) and value != [] and all(isinstance(item, dict) for item in value)
    return isinstance(value, str) and value != ""  # str, path, glob


def _check_value(dotted, kind, value, flag):
    """One key's value against its type and, for engine flags, its choices and range."""
    if not _type_ok(kind, value):
        raise ConfigError(f'"{dotted}" must be {TYPE_WORDS[kind]}, not {_shown(value)}')
    if isinstance(value, str) and "\0" in value:  # no command-line argument can hold one
        raise ConfigError(f'"{dotted}" must not contain a NUL character')
    if isinstance(value, float) and math.isnan(value):  # Python's json reads NaN; no range holds it
        raise ConfigError(f'"{dotted}" must be a number, not NaN')
    if not flag:
        return
    if isinstance(value, str) and has_lone_surrogate(value):  # the engine's argument could not hold it
        raise ConfigError(f'"{dotted}" holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape), which is '
                          'no text')
    if flag["choices"] and value not in flag["choices"]:
        raise ConfigError(f'"{dotted}" must be one of {", ".join(flag["choices"])}, '
                          f'not {_shown(value)}')
    if flag["min"] is not None and value < flag["min"]:
        raise ConfigError(f'"{dotted}" must be at least {flag["min"]}, not {_shown(value)}')
    if flag["max"] is not None and value > flag["max"]:
        raise ConfigError(f'"{dotted}" must be at most {flag["max"]}, not {_shown(value)}')


def _check_list(dotted, items, fields):
    """A list of objects against the flags of its fields: count, each field's type and range, and
    the fields every item needs."""
    most = max(f["items"] for f in fields.values())
    if len(items) > most:
        raise ConfigError(f'"{dotted}" holds {len(items)} items; at most {most}')
    for i, item in enumerate(items):
        for field, value in item.items():
            if field not in fields:
                raise ConfigError(f'unknown key "{dotted}[{i}].{field}"')
            _check_value(f"{dotted}[{i}].{field}", fields[field]["type"], value, fields[field])
        for field, f in fields.items():
            if f["required"] is True and field not in item:
                raise ConfigError(f'missing key "{dotted}[{i}].{field}"')


def _given(cfg, dotted):
    section, _, key = dotted.partition(".")
    return isinstance(cfg.get(section), dict) and key in cfg[section]


def _required_keys(cfg, flags):
    """Own required keys, required flags, and flags required once their section is there."""
    own = [key for key, (_, required) in OWN_KEYS.items() if required]
    return own + [name for name, f in flags.items() if "." in name and not f.get("items") and
                  (f["required"] is True or (f["required"] == "section" and name.split(".")[0] in cfg))]


def validate_config(cfg, flags):
    """Raise ConfigError naming the first unknown, mistyped, out-of-range or missing key."""
    if not isinstance(cfg, dict):
        raise ConfigError("the config must be a JSON object")
    keys = config_keys(flags)
    sections = {k.split(".")[0] for k in keys if "." in k}
    for key, value in cfg.items():
        if key in sections:
            if not isinstance(value, dict):
                raise ConfigError(f'"{key}" must be an object')
            for sub, subval in value.items():
                dotted = f"{key}.{sub}"
                if dotted not in keys:
                    raise ConfigError(f'unknown key "{dotted}"')
                _check_value(dotted, keys[dotted], subval, flags.get(dotted))
                if keys[dotted] == "list":
                    _check_list(dotted, subval, list_fields(flags)[dotted])
        elif "." in key:  # {"train.lr": 0.5} passed the checks and was then never read: a silent default
            section, _, sub = key.partition(".")
            raise ConfigError(f'unknown key "{key}" at the top level (a dotted key is nested: '
                              f'"{section}": {{"{sub}": ...}})')
        elif key in keys:
            _check_value(key, keys[key], value, None)
        else:
            raise ConfigError(f'unknown key "{key}"')
    for dotted in _required_keys(cfg, flags):
        section, _, sub = dotted.partition(".")
        if section not in cfg or (sub and sub not in cfg[section]):
            raise ConfigError(f'missing key "{dotted}"')
    for f in flags.values():
        given = [key for key in f.get("one_of") or [] if _given(cfg, key)]
        if f.get("one_of") and len(given) != 1:
            raise ConfigError(f'give one of "{f["one_of"][0]}" and "{f["one_of"][1]}"'
                              + (", not both" if given else f': missing key "{f["one_of"][0]}"'))
    _check_source_names(cfg.get("data", {}).get("sources", []))
    name = cfg["name"]
    if (not all(c.isalnum() or c in "._-" for c in name) or name.startswith(".")
            or len(name.encode("utf-8")) > NAME_MAX_BYTES):
        raise ConfigError(f'"name" must be letters, digits, ".", "_" or "-" (it names files; at '
                          f'most {NAME_MAX_BYTES} bytes in UTF-8), not {_shown(name)}')
    _check_length("description", cfg.get("description", ""), DESCRIPTION_MAX_CHARS)
    _check_length("sample.prompts", "".join(cfg.get("sample", {}).get("prompts", [])), PROMPTS_MAX_CHARS)


def _check_source_names(sources):
    """The sources' names, checked here as the engine checks them: found only by the engine, a name
    was first printed as it stood by the proxy's warnings (a newline in it forged an "error:" line)
    and the run directory made before the engine refused it."""
    first = {}
    for i, source in enumerate(sources):
        name = source["name"]
        if not SOURCE_NAME.fullmatch(name):
            raise ConfigError(f'"data.sources[{i}].name" must be letters, digits, ".", "_" or "-" (it names the '
                              f'source in records), not {_shown(name)}')
        if name in first:
            raise ConfigError(f'"data.sources[{i}].name" {_shown(name)} is already the name of '
                              f'data.sources[{first[name]}]')
        first[name] = i


def _shown(value, limit=60):
    """A value for an error message: JSON, cut short if long (quoted whole, a list pasted into the
    wrong key made the one error line megabytes long)."""
    shown = json.dumps(value)
    if len(shown) <= limit:
        return shown
    size = f"{len(value)} characters" if isinstance(value, str) else f"{len(shown)} characters of JSON"
    return f"{shown[:limit]}... ({size})"


def _check_length(key, text, limit):
    if len(text) > limit:
        raise ConfigError(f'"{key}" has {len(text)} characters; at most {limit} are allowed')


def resolve_path(p):
    """Config paths (and globs) are relative to the repository root, wherever the proxy runs."""
    p = os.path.expanduser(p)
    return p if os.path.isabs(p) else os.path.join(ROOT, p)


def tokenize_prompts(cfg, flags):
    """sample.prompts -> token id lists (ChatML specials allowed), checked against the vocabulary."""
    prompts = cfg.get("sample", {}).get("prompts", [])
    if not prompts:
        return []
    from microgpt import tokenizer  # tiktoken loads only for configs that sample
    vocab = cfg["model"].get("vocab_size", flags["model.vocab_size"]["default"])
    seq_len = cfg["model"]["seq_len"]
    out = []
    for i, text in enumerate(prompts):
        if has_lone_surrogate(text):  # tiktoken would encode it as U+FFFD without a word
            raise ConfigError(f'"sample.prompts[{i}]" holds a lone UTF-16 surrogate (a \\ud800-\\udfff '
                              'escape), which is no text')
        try:
            ids = tokenizer.encode_chat(text)
        except tokenizer.TokenizerUnavailable as e:
            raise ConfigError(f'"sample.prompts" cannot be tokenized: {e}') from None
        if len(ids) > seq_len:
            raise ConfigError(f'"sample.prompts[{i}]" is {len(ids)} tokens; the model sees at most '
                              f'model.seq_len ({seq_len})')
        too_big = [t for t in ids if t >= vocab]
        if too_big:
            raise ConfigError(f'"sample.prompts[{i}]" has token id {too_big[0]}, which is not below '
                              f'model.vocab_size {vocab}')
        if len(",".join(map(str, ids))) >= ARG_MAX_BYTES:
            raise ConfigError(f'"sample.prompts[{i}]" is too long to pass to the engine')
        out.append(ids)
    return out


def config_changes(old, new):
    """{key: [old value, new value]} for every dotted key whose value differs between two configs
    (None where a config lacks the key)."""
    before, after = _dotted(old), _dotted(new)
    return {k: [before.get(k), after.get(k)] for k in sorted(before.keys() | after.keys())
            if before.get(k) != after.get(k)}


def describe_changes(changes):
    """'train.lr 0.0006 -> 0.001, train.steps 2000 -> 4000' (long values cut short)."""
    word = lambda v: "(none)" if v is None else _shown(v, 40)  # noqa: E731
    return ", ".join(f"{k} {word(a)} -> {word(b)}" for k, (a, b) in changes.items())


def _dotted(cfg):
    return {f"{key}.{sub}" if isinstance(value, dict) else key: subval
            for key, value in cfg.items()
            for sub, subval in (value.items() if isinstance(value, dict) else [(None, value)])}


def config_values(cfg, flags):
    """{flag name: value} for every engine flag the config sets (not the proxy's own keys); a list
    key gives one flag per field of each item (data.sources[1].train -> data.sources.1.train)."""
    lists = list_fields(flags)
    values = {}
    for section, keys in cfg.items():
        if not isinstance(keys, dict):
            continue
        for key, value in keys.items():
            dotted = f"{section}.{key}"
            if dotted in lists:
                values.update({f"{dotted}.{i}.{field}": v for i, item in enumerate(value)
                               for field, v in item.items()})
            elif dotted in flags:
                values[dotted] = value
    return values


def flag_args(values, flags):
    """{flag name: value} -> the engine's command line, by each flag's type: booleans as bare
    flags, paths resolved against the repository, floats by repr (which round-trips a double)."""
    args = []
    for name, value in values.items():
        flag = item_flag(name, flags)
        kind = flag["type"] if flag else "str"
        if kind == "bool":
            args += [f"--{name}"] if value else []
            continue
        if kind in ("path", "glob"):
            value = resolve_path(value)
        elif kind == "float":
            value = repr(float(value))
        args += [f"--{name}", str(value)]
    return args


def engine_args(cfg, flags, prompt_ids, ckpt_path, resume):
    """The engine's command-line flags for a validated config: the dotted keys, mechanically."""
    args = flag_args({"name": cfg["name"], **config_values(cfg, flags)}, flags)
    for ids in prompt_ids:
        args += ["--sample.prompt", ",".join(str(t) for t in ids)]
    args += ["--checkpoint", ckpt_path]
    if resume:
        args.append("--resume")
    return args
