# The staging manifest, `<stage>_staging.json`: the seam between the launcher, which plans what a stage's job
# moves between S3 and the shared file system (launcher/staging.py), and the program the job runs on the node to
# move it (python -m runtime.io.staging). Both read the names below from here.
#
#   {"local_dir": "/fsx/staging",
#    "pulls":  [{"key": <stage config key>, "url": "s3://...", "local": <its mirror>, "kind": OBJECT|INDEXED|BLEND}],
#    "pushes": [{"key": ..., "url": ..., "local": ..., "kind": PUSH_TREE}]}
from __future__ import annotations

from pathlib import Path

from runtime.io.s3 import split_url

# Kinds of pull: one object; a Megatron prefix (<url>.bin and <url>.idx); a blend file whose s3:// prefixes are
# pulled too and rewritten to their mirrors. A push is a directory tree.
OBJECT, INDEXED, BLEND = "object", "indexed", "blend"
PUSH_TREE = "tree"


def mirror(url: str, local_dir: str) -> str:
    """Where s3://bucket/key lives on the shared file system: <local_dir>/bucket/key."""
    bucket, key = split_url(url)
    return str(Path(local_dir) / bucket / key) if key else str(Path(local_dir) / bucket)
