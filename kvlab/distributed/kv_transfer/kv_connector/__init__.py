"""The connectors' factory (``factory``) and their V1 interface and implementations (``v1``)."""
