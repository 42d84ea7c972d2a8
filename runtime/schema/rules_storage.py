"""Where data and checkpoints live: the S3 endpoint, URIs and bucket names, a checkpoint's name inside
checkpoint_dir and the config saved with it. Rules as runtime/schema/rules.py describes them; callers use them as
rules.<name>."""
from __future__ import annotations

import re


# ----------------------------------------------------------------------------------------------------------- s3
def endpoint_url(value: str, p: str) -> str | None:
    """boto3 takes a scheme and a host; a bare host name would fail on the node, at the first transfer."""
    if re.fullmatch(r"https?://[^\s/'\"\\][^\s'\"\\]*", value) and value.isprintable():
        return None
    return (f"{p}endpoint_url: {value!r} is not an http:// or https:// URL; give the S3 endpoint with its scheme, "
            f"e.g. {p}endpoint_url=https://s3.us-west-2.amazonaws.com (null: AWS S3 itself)")


_S3_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{0,62}")
# AWS's "characters to avoid" in object keys, and '$': none is needed, and each misleads a shell or a URL parser.
_S3_KEY_AVOID = '\\{}^%`[]"<>~#|$'


def s3_uri(value: object, key: str, *, patterns: bool = False) -> str | None:
    """s3://<bucket>/<object key>: a bucket name S3 takes, and a key without spaces, control characters (a newline
    would end the line it is printed on) or the characters AWS says to avoid. `patterns`: a key may hold {:02d}
    patterns (data_preparation's input.files)."""
    text = "" if value is None else str(value)
    example = f"e.g. {key}=s3://my-bucket/nxdt/file"
    if not text.startswith("s3://"):
        return f"{key}: {text!r} is not an S3 URI; give s3://<bucket>/<key>, {example}"
    bucket, _, path = text[len("s3://"):].partition("/")
    if not _S3_BUCKET.fullmatch(bucket):
        return (f"{key}: {text!r}: {bucket[:63]!r} is not an S3 bucket name (lowercase letters, digits, '.' and '-', "
                f"at most 63); {example}")
    if not path.strip("/"):
        return f"{key}: {text} names a bucket without a key; add the object's path"
    avoid = _S3_KEY_AVOID.replace("{", "").replace("}", "") if patterns else _S3_KEY_AVOID
    if bad := next((c for c in path if not c.isprintable() or c.isspace() or c in avoid), None):
        return (f"{key}: {text!r} holds {bad!r}; an S3 key here takes no spaces, control characters or any of "
                f"{avoid} (AWS's characters to avoid): rename the object, {example}")
    return None


def s3_bucket(value: object, key: str) -> str | None:
    """A bare bucket name (cluster-config's s3_access)."""
    if _S3_BUCKET.fullmatch(str(value)):
        return None
    return (f"{key}: {str(value)[:63]!r} is not an S3 bucket name (lowercase letters, digits, '.' and '-', at most "
            f"63), e.g. {key}=[my-data-bucket]")


# -------------------------------------------------------------------------------------------------- checkpoints
def checkpoint_name(name: str | None, key: str, directory_key: str) -> str | None:
    """A checkpoint_name names one checkpoint's directory inside checkpoint_dir (or 'latest'): a path, which could
    read any directory on the machine, is refused. Conversion and evaluation both take one."""
    if name is None:
        return None
    fix = "give one checkpoint's directory name in it (e.g. step_00000040.3f9c2a1b) or latest"
    if name.startswith("/") or ".." in name.split("/"):
        return f"{key}: {name!r} leaves {directory_key}; {fix}"
    if "/" in name or name in ("", "."):
        return f"{key}: {name!r} is not one directory name in {directory_key}; {fix}"
    return None


def checkpoint_config(text: str | bytes, path: str) -> tuple[dict | None, str | None]:
    """(the training config a checkpoint was saved with, None), or (None, one line naming its config.yaml) when the
    file is not YAML or not a mapping (edited by hand, damaged on disk). The launcher reads it at launch (a resume
    from another model's checkpoints), the conversion and evaluation stages on the node."""
    import yaml

    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = " ".join(str(getattr(error, "problem", None) or error).split())[:60]
        return None, (f"{path}: not valid YAML{at} ({what}); it is the config this checkpoint was saved with: "
                      f"restore it from a copy, or move the checkpoint's directory aside to use the one before")
    if not isinstance(config, dict):
        return None, (f"{path}: holds {type(config).__name__}, not the config this checkpoint was saved with; restore "
                      f"it from a copy, or move the checkpoint's directory aside to use the one before")
    return config, None
