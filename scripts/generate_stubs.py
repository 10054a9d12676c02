"""Regenerate the committed protobuf/gRPC stubs under rendezvous/v1/.

python scripts/generate_stubs.py          # write the stubs
python scripts/generate_stubs.py --check  # exit 1 if the committed stubs are stale
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTOS = sorted(p.relative_to(PROTO_ROOT) for p in (PROTO_ROOT / "rendezvous").rglob("*.proto"))
GENERATED_DIR = Path("rendezvous") / "v1"


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if the committed stubs are stale")
    args = parser.parse_args()
    if not args.check:
        generate(ROOT)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = [
            f.name
            for f in sorted((Path(tmp) / GENERATED_DIR).iterdir())
            if not (ROOT / GENERATED_DIR / f.name).exists()
            or not filecmp.cmp(f, ROOT / GENERATED_DIR / f.name, shallow=False)
        ]
    if stale:
        print(f"stale generated stubs: {', '.join(stale)}; run: python scripts/generate_stubs.py", file=sys.stderr)
        return 1
    print("generated stubs are fresh")
    return 0


if __name__ == "__main__":
    sys.exit(main())
