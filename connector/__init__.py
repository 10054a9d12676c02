"""vLLM integration: a KV connector that moves KV through kv-rendezvous, and a reference router.

- `rendezvous.connector.rendezvous_connector.RendezvousConnector`: load it with
  `kv_connector="RendezvousConnector", kv_connector_module_path="rendezvous.connector.rendezvous_connector"`.
- `rendezvous.connector.config.ConnectorConfig`: the `kv_connector_extra_config` keys.

Importing this package does not import vLLM.
"""

from rendezvous.connector.config import TRANSFER_ID_KEY, ConnectorConfig

__all__ = ["TRANSFER_ID_KEY", "ConnectorConfig"]
