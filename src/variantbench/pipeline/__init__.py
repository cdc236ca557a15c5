"""The pipeline: plan -> jobs (build, measure, cold start) -> an executor -> records -> one assembly."""
