"""Generate the Python code of the vlkv.v1 protos: ``python protos/codegen.py [--check]``.

The generated modules live beside the .proto files (package ``vlkv.v1``) and are committed;
``--check`` regenerates into a temporary folder and fails when the committed code is stale.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent
PACKAGE = ROOT / "vlkv" / "v1"


def generate(out_dir: Path) -> list[Path]:
    protos = sorted(PACKAGE.glob("*.proto"))
    args = [
        "protoc",
        f"-I{ROOT}",
        f"-I{Path(protoc.__file__).parent / '_proto'}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(ROOT)) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((out_dir / "vlkv" / "v1").glob("*_pb2*.py*"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the committed code is not current")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        generated = generate(Path(tmp))
        stale = []
        for path in generated:
            target = PACKAGE / path.name
            if args.check:
                if not target.exists() or not filecmp.cmp(path, target, shallow=False):
                    stale.append(path.name)
            else:
                shutil.copyfile(path, target)
        if args.check:
            committed = {p.name for p in PACKAGE.glob("*_pb2*.py*")}
            stale += sorted(committed - {p.name for p in generated})
            if stale:
                print(f"generated code is stale: {', '.join(stale)}; run python protos/codegen.py")
                return 1
            print("generated code is current")
        else:
            print(f"wrote {len(generated)} files to {PACKAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
