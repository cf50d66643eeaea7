"""How KV moves between roles and servers: export/open of KV stores, the ipc and dist transports, the mailbox of cancel
notices, gRPC clients of other servers."""
