"""Render every setup x launcher x container combination into a folder (`make render-examples`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_matrix import spec_matrix  # noqa: E402

from trainstack.render import render  # noqa: E402

out = Path(sys.argv[1] if len(sys.argv) > 1 else "build/scripts")
out.mkdir(parents=True, exist_ok=True)
for spec in spec_matrix():
    name = f"{spec.setup}-{spec.launcher}-{spec.container}-{'cpu' if spec.cpu else 'gpu'}.sbatch"
    (out / name).write_text(render(spec))
print(f"rendered {len(list(out.glob('*.sbatch')))} scripts into {out}")
