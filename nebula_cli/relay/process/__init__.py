"""The relay process (``server``), its worker port (``worker_port``) and status file
(``status``), and the worker side of the hop (``client``)."""
