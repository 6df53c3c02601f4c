"""The pass infrastructure: pass base classes and registry, ordering, pipeline text, the
run loop, checks, rollback, the analysis cache, instruments and the report.  It knows
nothing of any particular pass."""
