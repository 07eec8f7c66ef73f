"""The data plane (RDMABuffer and its transports) lands here with the data-plane issue."""
