"""The `openssh` transport kind: the user's own `ssh` over a master connection (`conn.py`:
`OpensshConn`, `CONN`; `transport.py`: `OpenSSHTransport`). Imports nothing when loaded."""
