"""Tools for a user and the tests alike: a local S3 server (SeaweedFS) and a Prefect server."""
