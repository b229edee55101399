"""The relay's network: frames on a connection (``wire``, ``framing``), reading a frame's meta
into a typed message (``schema``) and the peer link's own messages (``messages``: progress,
hello, ping, refusal), peer links and their AES-GCM records (``peers``, ``link``,
``gcm_records``, ``duplex``, ``buffers``), the worker hop on the relay's own host
(``local_socket``), what a peer may make a relay hold (``limits``) and WAN emulation
(``shaping``)."""
