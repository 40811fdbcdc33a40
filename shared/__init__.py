"""Code that both processes and SDK users import: wire protocol, config, sampling params,
client. No torch here."""
