"""Where kvlab's data files live: ``data/`` beside the package, or ``$KVLAB_DATA`` when set."""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR = Path(os.environ.get("KVLAB_DATA", Path(__file__).resolve().parents[1] / "data"))
