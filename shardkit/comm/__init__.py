"""Communication, measured and expected.

ledger   collectives parsed from compiled HLO (loop-aware)
cost     the analytic cost model of each strategy
contract declared collectives for any program, checked against its compiled HLO
report   measured vs expected, as text / JSON
plot     the same as pictures (needs matplotlib)
"""
