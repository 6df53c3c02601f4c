"""Facts about op families that several passes share."""
