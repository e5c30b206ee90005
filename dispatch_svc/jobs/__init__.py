"""What a job is and what is kept of it: records and limits, the spec's validation, the job book
(records, events, leases, queue rows) over its database schema, results and stored inputs."""
