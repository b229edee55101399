"""The `ssh` transport kind: a host reached with paramiko (`conn.py`: `SshConn`, `CONN`;
`transport.py`: `SSHTransport`, paramiko imported only when a connection opens). Imports nothing
when loaded."""
