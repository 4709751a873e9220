"""The client side: HTTP/1.1 and HTTP/2 connections, CORS, h11's output layout."""
