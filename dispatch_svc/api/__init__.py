"""The dispatcher's edge: the DispatchService adapter, proto <-> domain translation, the request
stream as an input feed, what a job's client is sent back, and the operators' status page."""
