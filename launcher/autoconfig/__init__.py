# The AutoConfigurator: `nxdt-launch autoconfig [OVERRIDES]` with a conf/search_config choice.
#
#   sizing.py  model size from the compute budget (6·N·T with attention) and the base config for it
#   search.py  the TP/PP/virtual-PP/micro-batch/recompute grid, filtered by validation and the memory estimate,
#              ranked by estimated step time
#   runner.py  the top candidates as short runs through the launcher's executors; their measurements
#   report.py  the CSV sorted by measured throughput, the best config, the terminal tables
#   driver.py  the steps in order
