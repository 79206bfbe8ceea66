"""``azure://<account>/<container>/prefix`` (Azure Blob Storage) on obstore
(:mod:`bt_agent.storage.engine`).

Credentials: the spec's secret (a connection string, a SAS token or the account key), else the
standard variables (``AZURE_STORAGE_CONNECTION_STRING``, ``AZURE_STORAGE_ACCOUNT_KEY`` or the
Azure CLI's ``AZURE_STORAGE_KEY``, ``AZURE_STORAGE_SAS_TOKEN``), else what the engine finds
itself (a workload or managed identity). A connection string's ``BlobEndpoint`` (Azurite's, a
private endpoint), or its account in its ``EndpointSuffix`` (another cloud's), is where requests
go; else the account's endpoint in Azure's global cloud.

Objects are not copied inside the service (``AzureStore.copy_refused``): callers upload instead.
Uploads carry no checksum the service verifies (the engine sends no ``Content-MD5``): the
sha256 each upload computes is checked where the object is read back (its metadata, up to the
part size; a checkpoint manifest's, as a checkpoint loads).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bt_agent.storage.credentials import AzureCredentials
from bt_agent.storage.engine import ENGINE_RETRIES, EngineStore, Proxies, Tuning

if TYPE_CHECKING:
    from obstore.store import AzureCredential


#: An account's blob endpoint in Azure's global cloud, where no connection string names another.
GLOBAL_ENDPOINT = "https://{account}.blob.core.windows.net"


class AzureStore(EngineStore):
    # Azure's Copy Blob may answer while the copy is still pending (the destination empty or
    # partial until it ends), and the engine neither waits for it nor shows its status: an
    # object copied could be committed, and read, before its bytes are there.
    copy_refused = "Azure's copies may end after they answer"
    ca_variable = "SSL_CERT_FILE"
    container_noun = "container"
    archived_hint = "rehydrate it to the hot or cool tier (az storage blob set-tier) or copy it"
    credentials_hint = (
        "name a secret holding the account key, a SAS token or a connection string, or set "
        "AZURE_STORAGE_CONNECTION_STRING (or AZURE_STORAGE_ACCOUNT_KEY, AZURE_STORAGE_SAS_TOKEN)"
    )

    def __init__(
        self,
        account: str,
        container: str,
        prefix: str = "",
        *,
        credentials: AzureCredentials | None = None,
        tuning: Tuning | None = None,
        ca_bundle: str | None = None,
        proxies: Proxies | None = None,
        token_identity: str | None = None,
        ca_variable: str | None = None,
    ) -> None:
        prefix = prefix.strip("/")
        named = credentials.endpoint if credentials else None
        url = f"azure://{account}/{container}" + (f"/{prefix}" if prefix else "")
        endpoint = named or GLOBAL_ENDPOINT.format(account=account)
        super().__init__(prefix, url, endpoint, tuning, ca_bundle, proxies, ca_variable)
        self.account = account
        self.container = container
        self.credentials = credentials or AzureCredentials()
        if token_identity:
            self.token_identity = token_identity

    def access_hint(self) -> str:
        if not self.credentials.sas_token:
            return super().access_hint()
        return (
            "check that the SAS token has not expired and allows what was asked: read and list "
            "for weights and loaded checkpoints, also write and delete for the store"
        )

    def _given(self) -> AzureCredential | None:
        """The engine's form of the credentials the agent was given, where it was given any."""
        if self.credentials.account_key:
            return {"access_key": self.credentials.account_key, "expires_at": None}
        if self.credentials.sas_token:
            return {"sas_token": self.credentials.sas_token, "expires_at": None}
        return None

    def _make_engine(self) -> Any:
        from obstore.store import AzureStore as Engine

        # The emulator's variable is read where the store is opened (:mod:`registry`): the
        # engine, reading it too, would send requests past the endpoint named here, with the
        # emulator's key in place of the credentials given.
        config: dict[str, Any] = {
            "account_name": self.account,
            "endpoint": self.endpoint_url,
            "use_emulator": False,
        }
        if given := self._given():
            config["credential_provider"] = _Given(given)
        return Engine(
            self.container,
            client_options=self._client_options(),
            retry_config=ENGINE_RETRIES,
            **config,
        )


class _Given:
    """The credentials the agent was given (the spec's secret's, or the standard variables'), as
    the engine's credential provider: they come before any the engine finds itself, which
    would otherwise take an account key of the process's environment over a SAS token."""

    def __init__(self, credential: AzureCredential) -> None:
        self.credential = credential

    def __call__(self) -> AzureCredential:
        return self.credential
