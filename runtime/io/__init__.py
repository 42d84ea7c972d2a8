# Reading and writing outside the process, in one place: atomic local publishing (files.py), used by data
# preparation, checkpoints, conversion and evaluation alike; the one S3 client and its settings (s3.py); and the
# staging program the job scripts run around a stage (staging.py, its manifest's format in manifest.py).
# Nothing here imports torch or numpy, and this file imports nothing: the launcher imports s3.py, manifest.py,
# files.py (json_lines) and run_lock.py.
