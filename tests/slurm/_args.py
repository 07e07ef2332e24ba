"""Torch-free program for the program-form tests: records the arguments it received as $PROBE_OUT/args.json."""

import json
import os
import sys
from pathlib import Path

record = {"argv": sys.argv[1:], "script": Path(sys.argv[0]).name, "module": __spec__.name if __spec__ else None,
          "cwd": os.getcwd()}
print("args:", json.dumps(record), flush=True)
(Path(os.environ["PROBE_OUT"]) / "args.json").write_text(json.dumps(record))
