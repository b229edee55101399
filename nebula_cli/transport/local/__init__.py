"""The `local` transport kind: this machine (`conn.py`: `LocalConn`, `CONN`; `transport.py`:
`LocalTransport`). Imports nothing when loaded."""
