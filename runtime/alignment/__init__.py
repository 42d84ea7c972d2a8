# Preference alignment (DPO, ORPO): preference-pair records, their tokenized dataset, and a synthetic demo set.
