"""``KVConnectorBase_V1`` (``base``), ``ExampleConnector`` (files) and ``P2pGlooConnector`` (gloo, NIXL's handshake)."""
