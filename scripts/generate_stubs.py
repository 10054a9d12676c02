"""Regenerate the committed protobuf/gRPC stubs under rendezvous/v1/, and rendezvous/protocol/reasons.py
(the error reasons of proto/rendezvous/v1/errors.proto as a Python enum with their status codes).

python scripts/generate_stubs.py          # write the stubs
python scripts/generate_stubs.py --check  # exit 1 if the committed stubs are stale
python scripts/generate_stubs.py --package my_engine.rdv --out src/   # stubs for code outside the service

The last writes the same stubs as Python package `my_engine.rdv` under src/ (src/my_engine/rdv/), for a router,
an engine or a tool that talks to the service without the SDK: generated as `rendezvous.v1` they would collide
with the installed service's own stub package. The protocol is unchanged (proto package `rendezvous.v1`, the same
descriptors), so both may be imported in one process. They import `google.rpc` from googleapis-common-protos.
"""

from __future__ import annotations

import argparse
import filecmp
import re
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTOS = sorted(p.relative_to(PROTO_ROOT) for p in (PROTO_ROOT / "rendezvous").rglob("*.proto"))
GENERATED_DIR = Path("rendezvous") / "v1"
REASONS = Path("rendezvous") / "protocol" / "reasons.py"
REASON_ENUM = "ErrorReason"
REASON_PREFIX = "ERROR_REASON_"


def generate(out_dir: Path) -> None:
    """Run protoc for every project proto, writing the package tree into out_dir."""
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{PROTO_ROOT / 'third_party'}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p) for p in PROTOS],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    (out_dir / REASONS).parent.mkdir(parents=True, exist_ok=True)
    (out_dir / REASONS).write_text(reasons_module(include))


def reasons_module(include: Path) -> str:
    """The Reason enum and each reason's status code, read from the ErrorReason enum and its comments."""
    from google.protobuf import descriptor_pb2

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "errors.desc"
        args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", "--include_source_info", f"--descriptor_set_out={out}"]
        if protoc.main([*args, "rendezvous/v1/errors.proto"]) != 0:
            raise SystemExit("protoc failed")
        files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    (proto,) = files.file
    found = re.search(r'option \(error_domain\) = "([^"]+)";', (PROTO_ROOT / "rendezvous/v1/errors.proto").read_text())
    if found is None:
        raise SystemExit("errors.proto: ErrorReason has no error_domain option")
    domain = found.group(1)
    index = next(i for i, e in enumerate(proto.enum_type) if e.name == REASON_ENUM)
    comments = {
        tuple(loc.path): loc.leading_comments.strip() for loc in proto.source_code_info.location if loc.leading_comments
    }
    lines = [
        '"""ErrorInfo reasons of the protocol and the status code each comes with.',
        "",
        "Generated from proto/rendezvous/v1/errors.proto by scripts/generate_stubs.py: do not edit.",
        "Plain Python (no protobuf import), so the service core and the SDK share it at no cost.",
        '"""',
        "",
        "from __future__ import annotations",
        "",
        "from collections.abc import Mapping",
        "from enum import StrEnum",
        "",
        f'ERROR_DOMAIN = "{domain}"',
        '"""The google.rpc.ErrorInfo domain of every reason (the `error_domain` option of ErrorReason)."""',
        "",
        "",
        "class Reason(StrEnum):",
        '    """The reason of a google.rpc.ErrorInfo in ERROR_DOMAIN."""',
        "",
    ]
    codes: list[str] = []
    for i, value in enumerate(proto.enum_type[index].value):
        if value.number == 0:
            continue
        name = value.name.removeprefix(REASON_PREFIX)
        code, _, doc = comments[(5, index, 2, i)].partition(": ")
        lines += [f'    {name} = "{name}"', f'    """{doc}"""', ""]
        codes.append(f'    Reason.{name}: "{code}",')
    lines[-1:] = [
        "",
        "",
        "REASON_CODES: Mapping[Reason, str] = {",
        *codes,
        "}",
        '"""The google.rpc.Code name of each reason."""',
    ]
    return "\n".join(lines) + "\n"


def relocate(generated: Path, package: str, out: Path) -> Path:
    """Copy the stubs generated under `generated` into `out` as Python package `package`; its folder."""
    if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", package) or package.split(".")[0] == "rendezvous":
        raise SystemExit(f"--package {package!r}: a dotted Python name outside `rendezvous`")
    target = out.joinpath(*package.split("."))
    target.mkdir(parents=True, exist_ok=True)
    old = GENERATED_DIR.as_posix().replace("/", ".")
    for source in sorted((generated / GENERATED_DIR).glob("*_pb2*.py*")):
        text = source.read_text()
        text = text.replace(f"from {old} import ", f"from {package} import ")  # the modules' imports of each other
        text = re.sub(rf"'{re.escape(old)}\.(\w+_pb2)'", rf"'{package}.\1'", text)  # the classes' module names
        (target / source.name).write_text(text)
    init = target / "__init__.py"
    if not init.exists():
        init.write_text(f'"""kv-rendezvous protocol stubs (proto package {old}), by scripts/generate_stubs.py."""\n')
    return target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if the committed stubs are stale")
    parser.add_argument("--package", help="write the stubs as this Python package instead (needs --out)")
    parser.add_argument("--out", type=Path, help="with --package: the folder the package goes under")
    args = parser.parse_args()
    if args.package or args.out:
        if not (args.package and args.out) or args.check:
            parser.error("--package and --out go together, without --check")
        with tempfile.TemporaryDirectory() as tmp:
            generate(Path(tmp))
            print(f"wrote {relocate(Path(tmp), args.package, args.out)}")
        return 0
    if not args.check:
        generate(ROOT)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        generated = [f.relative_to(tmp) for f in sorted((Path(tmp) / GENERATED_DIR).iterdir())] + [REASONS]
        stale = [
            str(f)
            for f in generated
            if not (ROOT / f).exists() or not filecmp.cmp(Path(tmp) / f, ROOT / f, shallow=False)
        ]
    if stale:
        print(f"stale generated stubs: {', '.join(stale)}; run: python scripts/generate_stubs.py", file=sys.stderr)
        return 1
    print("generated stubs are fresh")
    return 0


if __name__ == "__main__":
    sys.exit(main())
