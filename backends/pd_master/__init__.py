"""Master role: client API, tokenisation, admission, deadline, detokenisation and relay."""
