"""Write variant kernel configs: a base config (configs/<target>.yaml) with some knobs changed, for A/B
runs in one device call (tools/device_session.sh variants and small-table).

    python tools/config_variants.py --base configs/sm90.yaml --prefix /tmp/sm90_var_ \
        chunk128=backward.long_chunk:128 small=small_table.max_rows:64,small_table.groups:4

Each argument is name=section.key:value[,section.key:value...] (values in YAML; a value holding a
comma inside braces or brackets stays one value), or section.key.entry:value for one entry of a
per-width table (forward.gather.4:16: the gather at BLOCK_D 4; the table's other entries stay); each
variant goes to
<prefix><name>.yaml, whose path is printed. A key the section's config class does not have is an
error (the config loader ignores unknown keys, so a typo would otherwise time the base config twice),
and every written file must load as a valid config.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torchrec_triton_tbe import config as cfg_mod  # noqa: E402

SECTIONS = {
    "forward": cfg_mod.ForwardConfig,
    "transpose": cfg_mod.TransposeConfig,
    "backward": cfg_mod.BackwardConfig,
    "small_table": cfg_mod.SmallTableConfig,
    "precompile": cfg_mod.PrecompileConfig,
}


def parse_variant(arg: str) -> tuple[str, list[tuple[str, str, object, object]]]:
    """"name=section.key[.entry]:value,..." -> (name, [(section, key, entry or None, value)])."""
    name, sep, knobs = arg.partition("=")
    if not sep or not name or not knobs:
        raise ValueError(f"variant {arg!r}: expected name=section.key:value[,section.key:value...]")
    changes = []
    # Split on commas outside YAML braces/brackets ("backward.tile:{default: 8, 64: 4}").
    depth, part, parts = 0, "", []
    for ch in knobs:
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(part)
            part = ""
        else:
            part += ch
    parts.append(part)
    for kv in parts:
        path, sep, value = kv.partition(":")
        section, dot, key = path.partition(".")
        key, _, entry = key.partition(".")
        if not sep or not dot:
            raise ValueError(f"variant {name!r}: {kv!r} is not section.key:value")
        if section not in SECTIONS:
            raise ValueError(f"variant {name!r}: unknown section {section!r} (known: {sorted(SECTIONS)})")
        fields = {f.name for f in dataclasses.fields(SECTIONS[section])}
        if key not in fields:
            raise ValueError(f"variant {name!r}: {section} has no knob {key!r} (known: {sorted(fields)})")
        changes.append((section, key, yaml.safe_load(entry) if entry else None, yaml.safe_load(value)))
    return name, changes


def write_variants(base: Path, prefix: str, variants: list[str]) -> list[Path]:
    written = []
    for arg in variants:
        name, changes = parse_variant(arg)
        d = yaml.safe_load(base.read_text())
        for section, key, entry, value in changes:
            knobs = d.setdefault(section, {})
            if entry is None:
                knobs[key] = value
            else:
                table = knobs.get(key)
                if not isinstance(table, dict):
                    raise ValueError(f"variant {name!r}: {section}.{key} is not a per-width table in {base}")
                knobs[key] = {**table, entry: value}
        out = Path(f"{prefix}{name}.yaml")
        out.write_text(yaml.safe_dump(d))
        cfg_mod.load_named(str(out))  # validates (raises on a bad value)
        written.append(out)
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, default=Path("configs/sm90.yaml"))
    ap.add_argument("--prefix", required=True, help="output path prefix: <prefix><name>.yaml")
    ap.add_argument("variants", nargs="+")
    args = ap.parse_args(argv)
    for path in write_variants(args.base, args.prefix, args.variants):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
