# Reading and writing outside the process, in one place: atomic local publishing (files.py), used by data
# preparation, checkpoints, conversion and evaluation alike. Standard library only.
