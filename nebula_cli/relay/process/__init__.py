"""The relay process (``server``), its worker port (``worker_port``) and status file
(``status``), the worker side of the hop (``client``), and the hop's messages
(``worker_messages``)."""
