"""The operator's page: /ui on serve and on the gateway."""
