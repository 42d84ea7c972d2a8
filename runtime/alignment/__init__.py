# Preference alignment (DPO, ORPO): the tokenized dataset of preference pairs, the objective, the reference
# log-probabilities and a synthetic demo set. The pair records and truncation rules are runtime/schema's (records.py,
# preference_pairs.py), which a launch checks with.
