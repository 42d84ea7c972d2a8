# Tests of the preference-pair data pipeline and its synthetic demo set.
